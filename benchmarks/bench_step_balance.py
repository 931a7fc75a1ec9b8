"""Step balance across data-parallel ranks: how long ranks wait for the slowest, per training step.

    PYTHONPATH=. python benchmarks/bench_step_balance.py
    PYTHONPATH=. python benchmarks/bench_step_balance.py --time-samples 1000000    # balanced_packs' time

Metric: the sum over optimizer steps of the slowest rank's cost divided by the sum of the mean rank's cost
(1.0: no rank ever waits), a step being ``grad_accum`` micro-batches (one pack each) per rank. Every pack is
costed by the same model, :class:`vlm_pack.packing.PackCost` (Qwen2-VL-7B widths and depths: language model
linear + per-sample attention, vision tower per image from its patches). Plans compared:

(a) epoch   today's ``PackedMapDataset`` before step plans (``balance=EpochBalance()``): BFD packs, each rank's epoch
            total balanced by Karmarkar-Karp on the same count of packs, steps walked in one shuffled order.
(b) step    the step plan (``balance=StepBalance(grad_accum)``): the same BFD packs, sorted by cost, cut
            into groups of world_size * grad_accum, dealt by rounds to the least loaded ranks, groups shuffled.
(b') balanced  the default step plan's own packs (``StepBalance(grad_accum)``, ``packs="balanced"``): the
            same samples packed for the steps (``packing.balanced.balanced_packs``: as many packs as BFD's
            rounded up to whole steps of world_size * grad_accum, samples dearest first into the rank's share
            of a step furthest below its aim, each opened by an image sample), dealt by ``deal_units``. A plan
            keeps these where they take no more optimizer steps, break the image rule in no more steps and
            deal better than (b) (``keep_balanced``), else (b)'s packs.
(c) nemo    in the style of NeMo Automodel's vision-token-balanced greedy knapsack (our re-implementation,
            not their code): samples sorted by vision tokens (descending), each put into the open pack with
            the fewest vision tokens that still has room (a new pack when none has), packs dealt to (step,
            rank) in creation order, steps in the same shuffled order as (a).

Data: (1) the embedded demo set (``vlm_pack.demo``, 320 samples, forecast with the offline Qwen2-VL parts,
capacity 16,384); (2) a LLaVA-like synthetic mix: 20,000 samples, 15% text-only, 70% one image, 15% two, text
lognormal (median 250 tokens), images 64-1,280 vision tokens each (4 patches per token), capacity 16,384.
Where the packs do not divide by the ranks the largest are split, as a plan does. The demo is small: at 64
ranks its 58 packs become 64, one step (a partial one at grad-accum 4), so its 64-rank rows say little.

bound: :func:`vlm_pack.packing.balanced.step_lower_bound` for the samples at (b')'s number of steps: what no
plan can beat (a sample dearer than the ranks beside it can carry in tokens makes them wait).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from vlm_pack.data.plan import _split_for_ranks, deal_packs
from vlm_pack.packing import EpochBalance, StepBalance, pack, pack_costs, step_imbalance
from vlm_pack.packing.balanced import balanced_packs, deal_units, keep_balanced, step_lower_bound
from vlm_pack.packing.cost import PackCost, gather_ragged, image_patches
from vlm_pack.packing.steps import steps_short_of_images


class Table:
    """The arrays of a forecast ``LengthTable`` that the plans read."""

    def __init__(self, lengths: np.ndarray, image_ptr: np.ndarray, image_tokens: np.ndarray, patches: np.ndarray):
        self.lengths = lengths
        self.image_ptr = image_ptr
        self.image_tokens = image_tokens
        self.vision_tokens = np.add.reduceat(np.append(image_tokens, 0), image_ptr[:-1]) * (np.diff(image_ptr) > 0)
        self.num_patches = patches


def llava_like(n: int = 20_000, seed: int = 0) -> Table:
    rng = np.random.default_rng(seed)
    text = np.clip(rng.lognormal(np.log(250), 0.9, n).astype(np.int64), 16, 6000)
    images = rng.choice([0, 1, 2], n, p=[0.15, 0.70, 0.15])
    tokens = rng.integers(64, 1281, (n, 2))
    per_image = tokens[np.arange(2)[None, :] < images[:, None]]  # row-major: sample by sample
    ptr = np.concatenate([[0], np.cumsum(images)]).astype(np.int64)
    vision = np.add.reduceat(np.append(per_image, 0), ptr[:-1]) * (images > 0)
    return Table(text + vision, ptr, per_image.astype(np.int64), 4 * vision)


def demo(capacity: int) -> Table:
    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.demo import demo_shards
    from vlm_pack.offline import build_tokenizer
    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.vision import vision_spec

    pre = Preprocessor(build_tokenizer("qwen2_vl"), family="qwen2_vl", spec=vision_spec("qwen2_vl"))
    t = forecast_sources([str(p) for p in demo_shards()], preprocessor=pre, progress=False)
    keep = t.lengths <= capacity
    assert keep.all(), "the demo has samples over the capacity"
    return Table(t.lengths, t.image_ptr, t.image_tokens, t.num_patches)


def nemo_style(table: Table, capacity: int) -> list[np.ndarray]:
    """Packs by vision-token-balanced greedy knapsack (see the module docstring)."""
    vision = table.vision_tokens
    order = np.lexsort((np.arange(vision.size), -vision))
    n_packs = -(-int(table.lengths.sum()) // capacity)
    used = np.zeros(n_packs, np.int64)
    vis = np.zeros(n_packs, np.int64)
    members: list[list[int]] = [[] for _ in range(n_packs)]
    for i in order.tolist():
        room = used + table.lengths[i] <= capacity
        if not room.any():
            used, vis = np.append(used, 0), np.append(vis, 0)
            members.append([])
            room = used + table.lengths[i] <= capacity
        b = int(np.flatnonzero(room)[np.argmin(vis[room])])
        used[b] += table.lengths[i]
        vis[b] += vision[i]
        members[b].append(i)
    return [np.asarray(m, np.int64) for m in members if m]


def costs_of(table: Table, bins: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    members = np.concatenate(bins)
    ptr = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    patches = image_patches(table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches)
    patches, image_ptr = gather_ragged(patches, table.image_ptr, members)
    return pack_costs(table.lengths[members], ptr, patches, image_ptr), members, ptr


def run(name: str, table: Table, capacity: int, worlds: list[int], accums: list[int]) -> list[str]:
    bfd = [np.asarray(b, np.int64) for b in pack(table.lengths, capacity).bins]
    nemo = nemo_style(table, capacity)
    patches = image_patches(table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches)
    sample_costs = PackCost().sample_costs(table.lengths, patches, table.image_ptr)
    rows = []
    for w in worlds:
        bins = _split_for_ranks(bfd, w)
        costs, members, ptr = costs_of(table, bins)
        nbins = _split_for_ranks(nemo, w)
        ncosts = costs_of(table, nbins)[0]
        for k in accums:
            shuffle = np.random.default_rng([0, 0])
            epoch = deal_packs(table, table.lengths, members, ptr, w, EpochBalance())[0]
            epoch = epoch[:, shuffle.permutation(epoch.shape[1])]
            step = deal_packs(table, table.lengths, members, ptr, w, StepBalance(grad_accum=k, packs="bfd"))[0]
            t0 = time.perf_counter()
            image = np.diff(table.image_ptr) > 0
            bal_members, bal_ptr = balanced_packs(
                sample_costs, table.lengths, capacity, len(bfd), world_size=w, grad_accum=k, has_image=image
            )
            bal_costs = np.add.reduceat(sample_costs[bal_members], bal_ptr[:-1])
            bal_image = np.add.reduceat(np.diff(table.image_ptr)[bal_members], bal_ptr[:-1]) > 0
            bal = deal_units(bal_costs, w, k, has_image=bal_image)
            ms = (time.perf_counter() - t0) * 1e3
            steps = np.arange(len(nbins)).reshape(-1, w).T  # creation order: step s = packs s*w .. s*w+w-1
            steps = steps[:, np.random.default_rng([0, 0]).permutation(steps.shape[1])]
            bound = step_lower_bound(sample_costs, table.lengths, capacity, w, k, steps=-(-bal.shape[1] // k))
            short = steps_short_of_images(bal_image, bal, k)
            b, b2 = step_imbalance(costs, step, k), step_imbalance(bal_costs, bal, k)
            bfd_image = np.add.reduceat(np.diff(table.image_ptr)[members], ptr[:-1]) > 0
            plan = b2 if keep_balanced((bal_costs, bal_image, bal), (costs, bfd_image, step), k, True) else b
            rows.append(
                f"| {name} | {w} | {k} | {len(bfd)} / {len(bins)} / {bal_ptr.size - 1} | {-(-bal.shape[1] // k)} | "
                f"{step_imbalance(costs, epoch, k):.3f} | {b:.3f} | {b2:.3f} | **{plan:.3f}** | "
                f"{bound['bound']:.3f} | "
                f"{step_imbalance(ncosts, steps, k):.3f} | {short['short']} / {short['forced']} | {ms:.0f} |"
            )
    return rows


def time_balanced(n: int, capacity: int = 16384) -> None:
    """Time ``balanced_packs`` on ``n`` llava-like samples at 64 x 1 and 8 x 4, against BFD itself."""
    import os

    table = llava_like(n)
    patches = image_patches(table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches)
    costs = PackCost().sample_costs(table.lengths, patches, table.image_ptr)
    t0 = time.perf_counter()
    bfd = pack(table.lengths, capacity)
    bfd_s = time.perf_counter() - t0
    image = np.diff(table.image_ptr) > 0
    for w, k in [(64, 1), (8, 4)]:
        t0 = time.perf_counter()
        members, ptr = balanced_packs(
            costs, table.lengths, capacity, bfd.num_bins, world_size=w, grad_accum=k, has_image=image
        )
        seconds = time.perf_counter() - t0
        pc = np.add.reduceat(costs[members], ptr[:-1])
        per_rank = -(-bfd.num_bins // w)  # split until the ranks divide them
        bfd_steps = -(-per_rank // k)
        print(
            f"{n:,} samples, {w} ranks x grad-accum {k}: BFD {bfd_s:.2f} s, {bfd.num_bins:,} packs, {bfd_steps:,} "
            f"steps; balanced_packs {seconds:.1f} s, {ptr.size - 1:,} packs, {(ptr.size - 1) // (w * k):,} steps, "
            f"step imbalance {step_imbalance(pc, deal_units(pc, w, k), k):.4f}; load average {os.getloadavg()[0]:.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--time-samples", type=int, default=0, help="also time balanced_packs on this many llava-like samples"
    )
    args = ap.parse_args()
    if args.time_samples:
        time_balanced(args.time_samples)
        return
    print(
        "| data | ranks | grad-accum | packs: BFD / (b) split for ranks / (b') | steps (b') | (a) epoch | "
        "(b) step plan, BFD packs | (b') balanced packs | plan (default): keep_balanced's choice | bound | (c) nemo-style | "
        "(b') steps a rank lacks an image: short / forced | (b') packs + deal ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in run("demo (320, cap 16,384)", demo(16384), 16384, args.worlds, args.grad_accum):
        print(row)
    for row in run("llava-like (20,000, cap 16,384)", llava_like(), 16384, args.worlds, args.grad_accum):
        print(row)


if __name__ == "__main__":
    main()
