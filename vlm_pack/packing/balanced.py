"""Cost-balanced packs: the packs of a step plan made for its steps, each rank's share of a step about the same cost.

A step plan (:func:`~vlm_pack.packing.step_plan`) only chooses which packs meet in a step; when the packs
themselves cost very different amounts (a pack holding one long image beside packs of short text), no
dealing can balance the steps. Here the packs are made for the plan instead. A *unit* is one rank's share of
one step, its ``grad_accum`` packs (one pack at ``grad_accum == 1``)::

    K       the best-fit pack count rounded up to whole steps (a multiple of world_size * grad_accum):
            as many optimizer steps as the best-fit packs give; U = K / grad_accum units
    aims    the cost each unit is filled towards: T / U, unless some samples cost more than that
            ("giants": a unit holding one costs at least that much); then the units of a step holding
            giants aim at its dearest giant (its ranks wait for that one anyway), the rest share what is left
    seed    (``has_image``, where the packs placed by cost leave shares without an image that the image
            packs could fill) the U dearest image samples open a unit each, so every rank's share of every
            step holds an image (the image rule: a rank without one skips the vision tower, DDP's
            unused-parameter error or an FSDP hang); fewer where text-only samples need packs alone
    place   the rest dearest first, each into the unit furthest below its aim that has a pack with room
            (tokens, and any vision budget or samples-per-pack cap), there into the pack it fits best;
            one that no unit on offer takes joins the least-filled pack that holds it
    grow    only a sample no pack has room for opens one more step of units (the plan then keeps the
            best-fit packs: :func:`keep_balanced` never takes more optimizer steps)
    deal    units sorted by cost, cut into steps of world_size, dealt whole (:func:`deal_units`)

    costs  [7, 6, 5, 2, 2, 1, 1]   U = 3 units of one pack, room for every sample: aims 8, 8, 8
    unit 0  7 + 1        = 8       the three dearest open a unit each, then each goes to the unit
    unit 1  6 + 2        = 8       furthest below its aim: 2 -> unit 2 (5), 2 -> unit 1 (6),
    unit 2  5 + 2 + 1    = 8       1 -> unit 0 (7), 1 -> unit 2 (7)

Packs keep every limit the best-fit ones keep (``capacity`` tokens, ``vision_capacity``,
``max_samples_per_bin``); every sample is in exactly one pack, none empty; the same inputs give the same
packs. The packs this costs beyond best fit's are the rounding to whole steps (optimizer steps: the same),
plus a step where a sample fits in no pack (balanced packs fill by cost, not length, so they cannot always
match best fit's last 0.1%); :func:`keep_balanced` then keeps the best-fit packs.

:func:`step_lower_bound` is what no plan over the same samples can beat (a sample dearer than the ranks
beside it in its step can carry in their tokens makes them wait).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from .bins import _as_positive_int

__all__ = ["balanced_packs", "deal_units", "keep_balanced", "step_lower_bound"]


def _targets(sorted_costs: np.ndarray, units: int, world_size: int) -> np.ndarray:
    """float64 ``[units]``: the cost each unit (a rank's share of a step) is filled towards, units in the
    order the step plan will group them (dearest first, ``world_size`` a step).

    A sample dearer than the level ``lam`` the others can share (a *giant*) sets its unit's cost alone; the
    ``world_size`` units of a step holding giants aim at its dearest giant (its ranks wait for that one
    anyway), the rest share what is left: ``lam = (T - world_size * sum of those aims) / units left``, found
    by raising the count of giants until it is stable (it only grows, so at most ``units`` rounds)."""
    total = float(sorted_costs.sum())
    giants = 0
    while True:
        groups = min(-(-giants // world_size), units // world_size)
        aims = sorted_costs[0 : groups * world_size : world_size]
        left = units - groups * world_size
        lam = max(0.0, (total - world_size * float(aims.sum())) / left) if left else 0.0
        more = min(int(np.searchsorted(-sorted_costs, -lam, side="left")), units)  # costs > lam
        if more <= giants or not left:
            break
        giants = more
    return np.concatenate([np.repeat(aims, world_size), np.full(left, lam)])


_CHUNK = 1 << 20  # samples turned into Python lists at a time
_SCAN = 64  # units looked at and passed over per sample at most: then it goes to the least-filled share
_SUB_BITS = 3  # room classes per octave: 2^_SUB_BITS (the width of a class is 1/8 of its rooms)


def _room_class(room: int) -> int:
    """A class of free tokens, monotone in ``room``: its octave and the next ``_SUB_BITS`` bits, so rooms
    in one class differ by at most 1/8 (below ``2^_SUB_BITS`` each room is its own class)."""
    bits = room.bit_length()
    if bits <= _SUB_BITS:
        return room
    return ((bits - _SUB_BITS) << _SUB_BITS) + (room >> (bits - _SUB_BITS - 1))


class _Units:
    """The packs being filled, as Python lists (per-sample reads stay fast): ``free`` / ``vis_free`` /
    ``count`` per pack, and per unit its ``gap`` (cost placed - target) and a ``version`` that marks its
    older heap entries stale. ``heaps[c]``: units whose roomiest open pack is in room class ``c``, keyed
    ``(gap, unit, version)``. ``roomy``: every pack with room, most room first (``(-free, pack)``), made
    the first time a sample fits no unit the heaps offer."""

    def __init__(self, targets: np.ndarray, limits: tuple[int, int, int], per_unit: int, world_size: int):
        self.capacity, self.vision_capacity, self.sample_cap = limits
        self.per_unit, self.world_size = per_unit, world_size
        units = targets.size
        self.free = [self.capacity] * (units * per_unit)
        self.vis_free = [self.vision_capacity] * (units * per_unit)
        self.count = [0] * (units * per_unit)
        self.gap = (-targets).tolist()
        self.version = [0] * units
        self.heaps: list[list[tuple[float, int, int]]] = [[] for _ in range(_room_class(self.capacity) + 1)]
        self.fresh = float(targets.min()) if units else 0.0  # the aim of a unit opened later
        self.roomy: list[tuple[int, int]] | None = None

    def fits(self, p: int, length: int, vis: int) -> bool:
        return self.free[p] >= length and self.vis_free[p] >= vis and self.count[p] < self.sample_cap

    def put(self, p: int, length: int, vis: int, cost: float) -> None:
        """Sample into pack ``p``; its unit's gap grows by ``cost`` (its heap entry is pushed by :meth:`push`)."""
        u = p // self.per_unit
        self.free[p] -= length
        self.vis_free[p] -= vis
        self.count[p] += 1
        self.gap[u] += cost
        self.version[u] += 1
        if self.roomy is not None and self.free[p] > 0:
            heapq.heappush(self.roomy, (-self.free[p], p))

    def push(self, u: int, shortest: int) -> None:
        """Offer unit ``u`` to samples of ``shortest`` tokens or more, in the class of its roomiest open pack."""
        packs = range(u * self.per_unit, (u + 1) * self.per_unit)
        room = max([self.free[p] for p in packs if self.count[p] < self.sample_cap], default=0)
        if shortest and room >= shortest:
            heapq.heappush(self.heaps[_room_class(room)], (self.gap[u], u, self.version[u]))

    def open_step(self) -> int:
        """``world_size`` more units (one more step), aimed at the lowest target: the first one's id."""
        first, more = len(self.version), self.world_size * self.per_unit
        self.free += [self.capacity] * more
        self.vis_free += [self.vision_capacity] * more
        self.count += [0] * more
        self.gap += [-self.fresh] * self.world_size
        self.version += [0] * self.world_size
        if self.roomy is not None:
            for p in range(first * self.per_unit, len(self.free)):
                heapq.heappush(self.roomy, (-self.capacity, p))
        return first


def _place(
    order: np.ndarray,
    costs: np.ndarray,
    lengths: np.ndarray,
    vision: np.ndarray | None,
    units: _Units,
    seeds: np.ndarray,
) -> np.ndarray:
    """int64 ``[N]``: the pack of each sample (unit ``u`` holds packs ``u * per_unit ..``).

    ``seeds`` (``[S]``, ``S <= U``) go first, one into the first pack of each of units ``0 .. S-1`` (the
    image rule: each unit then holds an image). Then ``order`` (``[N - S]``, processing order) one at a
    time into the unit furthest below its target that has a pack with room, and there into the pack with
    least room that holds it (best fit); a sample no unit the heaps offer can take joins the least-filled
    pack that holds it (:func:`_least_filled`), and opens one more step only where no pack has room.

    Units are kept in one heap per room class (:func:`_room_class`), keyed ``(gap, unit)``, stale entries
    skipped by a version: a sample reads the top of each class above its length's (all of whose units have
    room), and its own class only when those are empty, passing over ``_SCAN`` units at most, so a sample
    costs O(classes + log U), never a scan of full units. A unit whose room falls below every sample still
    to come leaves for good."""
    n = costs.size
    vis = vision if vision is not None else np.zeros(n, dtype=np.int64)
    pack_of = np.empty(n, dtype=np.int64)
    for u, i in enumerate(seeds.tolist()):
        units.put(u * units.per_unit, int(lengths[i]), int(vis[i]), float(costs[i]))
        pack_of[i] = u * units.per_unit
    ordered_len = lengths[order]
    tail_min = np.append(np.minimum.accumulate(ordered_len[::-1])[::-1], 0)  # shortest still to come, and 0
    first = int(tail_min[0])
    for u in sorted(range(len(units.version)), key=lambda u: (units.gap[u], u)):
        units.push(u, first)
    ordered_cost, ordered_vis = costs[order], vis[order]
    for start in range(0, order.size, _CHUNK):
        # Python lists a chunk at a time: per-sample reads stay fast, memory stays O(chunk + U)
        stop = min(order.size, start + _CHUNK)
        seq = zip(
            ordered_len[start:stop].tolist(), ordered_cost[start:stop].tolist(),
            ordered_vis[start:stop].tolist(), tail_min[start + 1 : stop + 1].tolist(),
        )  # fmt: skip
        pack_of[order[start:stop]] = [_place_one(units, *sample) for sample in seq]
    return pack_of


def _place_one(units: _Units, length: int, cost: float, need_vis: int, after: int) -> int:
    """The pack of one sample (:func:`_place`); ``after``: the shortest length still to come (0: none)."""
    best: tuple[float, int, int] | None = None
    best_pack = -1
    aside: list[tuple[int, tuple[float, int, int]]] = []
    heaps, version = units.heaps, units.version
    # the classes above the sample's own, where every unit has room (unless a vision budget or sample cap
    # says no); its own class (some units there have room, some not) only when they have none
    own = _room_class(length)
    for j in [*range(len(heaps) - 1, own, -1), own]:
        if j == own and best is not None:
            break
        heap = heaps[j]
        while heap and len(aside) < _SCAN:
            entry = heap[0]
            u = entry[1]
            if entry[2] != version[u]:
                heapq.heappop(heap)  # stale: the unit has moved on
                continue
            if best is not None and entry >= best:
                break  # no better than the best so far
            fit = -1
            for p in range(u * units.per_unit, (u + 1) * units.per_unit):
                if units.fits(p, length, need_vis) and (fit < 0 or units.free[p] < units.free[fit]):
                    fit = p
            if fit >= 0:
                best, best_pack = entry, fit
                break
            aside.append((j, heapq.heappop(heap)))  # too little room for this one, not for later ones
    for j, entry in aside:
        heapq.heappush(heaps[j], entry)
    if best_pack < 0:
        best_pack = _least_filled(units, length, need_vis)
    if best_pack < 0:  # no pack has room: one more step of empty units (length <= capacity fits there)
        best_pack = units.open_step() * units.per_unit
    u = best_pack // units.per_unit
    units.put(best_pack, length, need_vis, cost)
    units.push(u, after)
    return best_pack


def _least_filled(units: _Units, length: int, need_vis: int) -> int:
    """The pack of a sample no unit the heaps offer can take: of the ``_SCAN`` roomiest packs that hold it,
    the one whose unit is furthest below its target; -1 when none does (then a step opens)."""
    if units.roomy is None:
        units.roomy = [(-f, p) for p, f in enumerate(units.free) if f > 0]
        heapq.heapify(units.roomy)
    roomy, free = units.roomy, units.free
    seen: list[tuple[int, int]] = []
    best = -1
    while roomy and -roomy[0][0] >= length and len(seen) < _SCAN:
        key, p = heapq.heappop(roomy)
        if -key != free[p]:
            continue  # stale: the pack has filled since
        seen.append((key, p))
        lower = best < 0 or units.gap[p // units.per_unit] < units.gap[best // units.per_unit]
        if lower and units.fits(p, length, need_vis):
            best = p
    for entry in seen:
        heapq.heappush(roomy, entry)
    return best


def _fill_empty(
    pack_of: np.ndarray, costs: np.ndarray, num_packs: int, per_unit: int, image: np.ndarray
) -> None:
    """Give every empty pack one sample, in place: first a sample of another pack of its own unit (the
    unit's cost does not move), else the cheapest text-only sample of a pack holding two or more (images
    last, so a unit keeps its image). Needs ``N >= num_packs``."""
    sizes = np.bincount(pack_of, minlength=num_packs)
    empty = np.flatnonzero(sizes == 0)
    if not empty.size:
        return
    counts = sizes.tolist()
    by_pack = np.argsort(pack_of, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    left: list[int] = []
    for e in empty.tolist():
        u = e // per_unit
        donor = max(range(u * per_unit, (u + 1) * per_unit), key=lambda p: (counts[p], -p))
        if counts[donor] < 2:
            left.append(e)
            continue
        held = [i for i in by_pack[starts[donor] : starts[donor + 1]].tolist() if pack_of[i] == donor]
        i = min(held, key=lambda i: (costs[i], i))
        counts[donor] -= 1
        counts[e] += 1
        pack_of[i] = e
    for i in np.lexsort((np.arange(costs.size), costs, image)).tolist():  # text-only first, cheapest first
        if not left:
            return
        if counts[pack_of[i]] >= 2:
            counts[pack_of[i]] -= 1
            pack_of[i] = left.pop()


def balanced_packs(
    costs: np.ndarray,
    lengths: np.ndarray,
    capacity: int,
    num_packs: int,
    *,
    world_size: int = 1,
    grad_accum: int = 1,
    vision: np.ndarray | None = None,
    vision_capacity: int | None = None,
    max_samples_per_bin: int | None = None,
    has_image: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Pack samples into whole steps whose every rank's share costs about the same (module docstring).

    Args:
        costs: float ``[N]`` each sample's cost (``PackCost.sample_costs``); a pack costs their sum.
        lengths: int64 ``[N]`` each sample's span in tokens, ``1..capacity`` (oversized samples left out
            before, as :func:`~vlm_pack.packing.pack` does).
        capacity: tokens per pack.
        num_packs: packs to start from (the best-fit count); rounded up to whole steps.
        world_size, grad_accum: ranks, and packs per rank per step; a *unit* is one rank's ``grad_accum``
            packs of one step, and units are balanced, not single packs.
        vision, vision_capacity: int64 ``[N]`` a second per-sample budget and its per-pack limit (both or
            neither), as :func:`~vlm_pack.packing.pack` takes them; each ``vision[i] <= vision_capacity``.
        max_samples_per_bin: samples per pack at most (None: no cap).
        has_image: bool ``[N]``: which samples hold an image (None: no care). Given, every unit (a rank's
            share of a step) holds one wherever the image packs could fill every step: where the packs
            placed by cost leave shares without one, each unit opens with one of the dearest image samples
            (not in a step added for a sample no pack has room for: a plan then keeps the best-fit packs).

    Returns:
        ``(members int64 [N], bin_ptr int64 [K + 1])``, ``K`` a multiple of ``world_size * grad_accum``:
        pack ``b`` is ``members[bin_ptr[b]:bin_ptr[b+1]]``, none empty; packs ``u * grad_accum ..
        (u + 1) * grad_accum - 1`` are unit ``u``, to be dealt together (:func:`deal_units`); samples inside
        a pack dearest first. None when there are fewer samples than one step has packs.

    Time O(N (log U + C)) for ``U`` units and ``C = log2(capacity)`` room classes (one heap per class).
    """
    capacity = _as_positive_int(capacity, "capacity")
    world_size = _as_positive_int(world_size, "world_size")
    grad_accum = _as_positive_int(grad_accum, "grad_accum")
    c = np.asarray(costs, dtype=np.float64)
    lens = np.asarray(lengths, dtype=np.int64)
    n = lens.size
    if c.shape != (n,):
        raise ValueError(f"balanced_packs: {c.size} costs for {n} lengths: give one cost per sample")
    if n and (int(lens.min()) < 1 or int(lens.max()) > capacity):
        bad = int(np.flatnonzero((lens < 1) | (lens > capacity))[0])
        raise ValueError(
            f"balanced_packs: sample {bad} has length {int(lens[bad])}, outside 1..capacity {capacity}: leave "
            "oversized samples out first (pack(..., oversized='skip') lists them)"
        )
    vis, vcap = _checked_vision(vision, vision_capacity, n)
    cap = n + 1 if max_samples_per_bin is None else _as_positive_int(max_samples_per_bin, "max_samples_per_bin")
    step = world_size * grad_accum
    if n < step:
        return None
    order = np.lexsort((np.arange(n), -lens, -c))  # dearest first, then longest, then by index
    k = max(step, -(-_as_positive_int(num_packs, "num_packs") // step) * step)
    targets = _targets(c[order], k // grad_accum, world_size)
    image = np.zeros(n, bool) if has_image is None else np.asarray(has_image, dtype=bool)
    if image.shape != (n,):
        raise ValueError(f"balanced_packs: has_image must be [N] = [{n}] bools, one per sample")
    limits, shape = (capacity, vcap, cap), (grad_accum, world_size)
    return _packed(order, c, lens, vis, limits, targets, shape, image, has_image is not None)


def _packed(
    order: np.ndarray,
    c: np.ndarray,
    lens: np.ndarray,
    vis: np.ndarray | None,
    limits: tuple[int, int, int],
    targets: np.ndarray,
    shape: tuple[int, int],
    image: np.ndarray,
    image_rule: bool,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`balanced_packs`' packs of the samples in processing ``order``: placed by cost, then (under the
    ``image_rule``) seeded with image samples where that leaves steps short the image packs could fill.
    ``shape``: (grad_accum, world_size)."""
    grad_accum, world_size = shape
    placed = None
    # first as the costs place them (images are dear: most shares get one anyway); seeded where that leaves
    # shares without an image that the image packs could fill, as seeds cost best fit's tightness
    for seeds in (np.zeros(0, np.int64), None):
        if seeds is None:
            seeds = _seeds(c, lens, image, limits[0], targets.size, grad_accum)
        units = _Units(targets, limits, grad_accum, world_size)
        pack_of = _place(order[~np.isin(order, seeds)], c, lens, vis, units, seeds)
        k = len(units.version) * grad_accum
        if k > c.size:  # more packs than samples: they would not all hold one
            return placed
        _fill_empty(pack_of, c, k, grad_accum, image)
        placed = _by_unit_cost(pack_of, c, k, grad_accum)
        grew = len(units.version) > targets.size  # a step more than asked: the plan keeps best fit's packs
        if grew or not image_rule or not _shares_lack_images(pack_of, image, k, grad_accum, world_size):
            break
    return placed


def _shares_lack_images(pack_of: np.ndarray, image: np.ndarray, k: int, per_unit: int, world_size: int) -> bool:
    """Whether, dealt (:func:`deal_units` spreads the shares holding an image ``world_size`` a step), fewer
    steps would give every rank an image than the image packs could: ``pack_of`` ``[N]``, ``K`` packs."""
    packs = np.bincount(pack_of, weights=image, minlength=k) > 0  # [K] packs holding an image
    shares = packs.reshape(-1, per_unit).any(axis=1)  # [U]
    steps = shares.size // world_size
    return int(shares.sum()) // world_size < min(steps, int(packs.sum()) // world_size)


def _checked_vision(vision: Any, vision_capacity: Any, n: int) -> tuple[np.ndarray | None, int]:
    """``(vision int64 [N] or None, vision_capacity or 0)``, or a ValueError saying what to give."""
    if (vision is None) != (vision_capacity is None):
        raise ValueError("balanced_packs: give vision and vision_capacity together, or neither")
    if vision is None:
        return None, 0
    vis = np.asarray(vision, dtype=np.int64)
    vcap = _as_positive_int(vision_capacity, "vision_capacity")
    if vis.shape != (n,) or (n and int(vis.max()) > vcap):
        raise ValueError(
            f"balanced_packs: vision must be [N] = [{n}] values each <= vision_capacity {vcap}; leave "
            "samples over the vision budget out first"
        )
    return vis, vcap


def _seeds(
    costs: np.ndarray, lengths: np.ndarray, image: np.ndarray, capacity: int, units: int, per_unit: int
) -> np.ndarray:
    """int64 ``[S]``: the image samples that open units ``0 .. S-1``, one each, dearest first: the dearest
    image samples (placed early by the dearest-first order anyway, they leave the small samples to fill the
    gaps last), as many as there are units, less one for each pack a text-only sample needs alone (longer
    than the room beside the shortest of them; ``per_unit`` packs a unit, one of them seeded)."""
    ids = np.flatnonzero(image)
    if not ids.size or not units:
        return np.zeros(0, dtype=np.int64)
    cheap = ids[np.lexsort((ids, -lengths[ids], -costs[ids]))][:units]  # dearest first
    alone = int((lengths[~image] > capacity - int(lengths[cheap].min())).sum())
    cheap = cheap[: max(0, min(cheap.size, units * per_unit - alone))]
    return cheap[np.lexsort((cheap, -costs[cheap]))].astype(np.int64)


def _by_unit_cost(pack_of: np.ndarray, costs: np.ndarray, k: int, per_unit: int) -> tuple[np.ndarray, np.ndarray]:
    """``(members [N], bin_ptr [K + 1])``: units dearest first (ties by unit id), a unit's packs together."""
    unit_cost = np.bincount(pack_of // per_unit, weights=costs, minlength=k // per_unit)
    units = np.lexsort((np.arange(unit_cost.size), -unit_cost))
    new_unit = np.empty_like(units)
    new_unit[units] = np.arange(units.size)
    new_id = new_unit[pack_of // per_unit] * per_unit + pack_of % per_unit
    place = np.lexsort((np.arange(pack_of.size), -costs))  # inside a pack: dearest first
    members = place[np.argsort(new_id[place], kind="stable")]
    bin_ptr = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.bincount(new_id, minlength=k), out=bin_ptr[1:])
    return members.astype(np.int64), bin_ptr


def deal_units(
    pack_costs: np.ndarray,
    world_size: int,
    grad_accum: int,
    *,
    has_image: np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """:func:`~vlm_pack.packing.step_plan` of :func:`balanced_packs`'s units: int64 ``[world_size, B //
    world_size]`` pack ids, unit ``u`` (packs ``u * grad_accum ..``) one rank's whole share of one step.

    ``pack_costs`` float ``[B]`` (``B`` a multiple of ``world_size * grad_accum``), ``has_image`` bool
    ``[B]``: a unit holds an image when any of its packs does, and every rank gets such a unit in every step
    with at least ``world_size`` of them."""
    from .steps import step_plan

    c = np.asarray(pack_costs, dtype=np.float64).reshape(-1, grad_accum)  # [U, grad_accum]
    image = None if has_image is None else np.asarray(has_image, dtype=bool).reshape(-1, grad_accum).any(axis=1)
    units = step_plan(c.sum(axis=1), world_size, 1, has_image=image, seed=seed)  # [W, steps]
    packs = units[:, :, None] * grad_accum + np.arange(grad_accum)  # [W, steps, grad_accum]
    return packs.reshape(world_size, -1).astype(np.int64)


def keep_balanced(
    balanced: tuple[np.ndarray, np.ndarray, np.ndarray],
    best_fit: tuple[np.ndarray, np.ndarray, np.ndarray],
    grad_accum: int,
    image_rule: bool,
) -> bool:
    """Whether a plan trains on its balanced packs rather than the best-fit ones: each a ``(pack costs float
    [B], has_image bool [B], rank_bins [world_size, micro_steps])``. Never when they take more optimizer
    steps; under the image rule (``image_rule``), never when more of their steps leave a rank without an
    image than the image packs force (:func:`~vlm_pack.packing.steps.steps_short_of_images`, "avoidable"),
    and always when fewer; else when they deal better (:func:`~vlm_pack.packing.step_imbalance`)."""
    from .steps import step_imbalance, steps_short_of_images

    (new_costs, new_image, new_bins), (old_costs, old_image, old_bins) = balanced, best_fit
    if -(-new_bins.shape[1] // grad_accum) > -(-old_bins.shape[1] // grad_accum):
        return False
    if image_rule:
        new_short = steps_short_of_images(new_image, new_bins, grad_accum)["avoidable"]
        old_short = steps_short_of_images(old_image, old_bins, grad_accum)["avoidable"]
        if new_short != old_short:
            return new_short < old_short
    return step_imbalance(new_costs, new_bins, grad_accum) < step_imbalance(old_costs, old_bins, grad_accum)


def _densest(costs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [n + 1], cost [n + 1])``: the samples densest first (cost per token), running sums from 0."""
    order = np.argsort(-(costs / lengths), kind="stable")
    return np.concatenate([[0.0], np.cumsum(lengths[order])]), np.concatenate([[0.0], np.cumsum(costs[order])])


def _carry(run: tuple[np.ndarray, np.ndarray], tokens: float) -> float:
    """An upper bound on the cost of any samples of ``run`` (:func:`_densest`) with at most ``tokens``
    tokens in all: the fractional knapsack, densest first."""
    span, cum = run
    whole = int(np.searchsorted(span, tokens, side="right")) - 1  # samples that fit whole
    if whole >= span.size - 1:
        return float(cum[-1])
    rate = (cum[whole + 1] - cum[whole]) / (span[whole + 1] - span[whole])
    return float(cum[whole] + rate * (tokens - span[whole]))


def step_lower_bound(
    costs: np.ndarray,
    lengths: np.ndarray,
    capacity: int,
    world_size: int,
    grad_accum: int = 1,
    steps: int | None = None,
) -> dict[str, Any]:
    """What no plan of these samples on ``world_size`` ranks in ``steps`` steps can beat: a lower bound on
    :func:`~vlm_pack.packing.step_imbalance` (sum over steps of the slowest rank's cost / the mean's).

    ``costs`` float ``[N]``, ``lengths`` int64 ``[N]``; a rank's share of a step is ``grad_accum`` packs of
    at most ``capacity`` tokens. ``T`` the total cost, ``W`` the ranks; the sum of the slowest is at least
    ``T / W`` (1.0), plus ``1 / W`` of every wait (a rank's cost below its step's slowest), so:

    * ``one_step``: the dearest sample ``c_1`` alone, when there is one step (``steps == 1``);
    * ``dearest``: the other ``W - 1`` ranks of ``c_1``'s step wait at least ``(W - 1) c_1 - F``, ``F`` the
      most that ``(W - 1) grad_accum capacity`` tokens of the other samples can cost (fractional knapsack,
      densest first: an upper bound on any packing);
    * ``giants`` (``grad_accum == 1``): the ``g`` dearest samples (``g <= 4 W``, the cheapest of them ``t``)
      each longer than half a pack, so no two share a rank's step: the ``m >= ceil(g / W)`` steps holding
      them hold ``L = m W - g`` ranks without one, which wait at least ``L t - F(L capacity)`` in all, the
      least over ``m <= steps``.

    Returns ``{"bound", "one_step", "dearest", "giants"}``, each a ratio to ``T / W``.
    """
    world_size = _as_positive_int(world_size, "world_size")
    grad_accum = _as_positive_int(grad_accum, "grad_accum")
    c = np.asarray(costs, dtype=np.float64)
    lens = np.asarray(lengths, dtype=np.float64)
    total = float(c.sum())
    out = {"bound": 1.0, "one_step": 1.0, "dearest": 1.0, "giants": 1.0}
    if c.size == 0 or total <= 0:
        return out
    order = np.lexsort((np.arange(c.size), -c))
    top = float(c[order[0]])
    if steps == 1:
        out["one_step"] = max(1.0, top * world_size / total)
    others = _densest(c[order[1:]], lens[order[1:]])
    wait = (world_size - 1) * top - _carry(others, (world_size - 1) * grad_accum * capacity)
    out["dearest"] = 1.0 + max(0.0, wait) / total
    most = steps if steps is not None else -(-c.size // world_size)
    if grad_accum == 1:
        best = 0.0
        for g in range(1, min(c.size, 4 * world_size) + 1):
            if float(lens[order[g - 1]]) * 2 <= capacity:
                break  # two could share a pack: no longer a bound
            t, rest = float(c[order[g - 1]]), _densest(c[order[g:]], lens[order[g:]])
            first = -(-g // world_size)
            waits = [m * world_size - g for m in range(first, max(first, most) + 1)]
            best = max(best, min(max(0.0, left * t - _carry(rest, left * capacity)) for left in waits))
        out["giants"] = 1.0 + best / total
    out["bound"] = max(out["one_step"], out["dearest"], out["giants"])
    return out
