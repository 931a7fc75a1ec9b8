"""Step balance across data-parallel ranks: how long ranks wait for the slowest, per training step.

    PYTHONPATH=. python benchmarks/bench_step_balance.py

Metric: the sum over optimizer steps of the slowest rank's cost divided by the sum of the mean rank's cost
(1.0: no rank ever waits), a step being ``grad_accum`` micro-batches (one pack each) per rank. Every pack is
costed by the same model, :class:`vlm_pack.packing.PackCost` (Qwen2-VL-7B widths and depths: language model
linear + per-sample attention, vision tower per image from its patches). Plans compared:

(a) epoch   today's ``PackedMapDataset`` before step plans (``balance="epoch"``): BFD packs, each rank's epoch
            total balanced by Karmarkar-Karp on the same count of packs, steps walked in one shuffled order.
(b) step    the step plan (``balance=StepBalance(grad_accum)``): the same BFD packs, sorted by cost, cut
            into groups of world_size * grad_accum, dealt by rounds to the least loaded ranks, groups shuffled.
(c) nemo    in the style of NeMo Automodel's vision-token-balanced greedy knapsack (our re-implementation,
            not their code): samples sorted by vision tokens (descending), each put into the open pack with
            the fewest vision tokens that still has room (a new pack when none has), packs dealt to (step,
            rank) in creation order, steps in the same shuffled order as (a).

Data: (1) the embedded demo set (``vlm_pack.demo``, 320 samples, forecast with the offline Qwen2-VL parts,
capacity 16,384); (2) a LLaVA-like synthetic mix: 20,000 samples, 15% text-only, 70% one image, 15% two, text
lognormal (median 250 tokens), images 64-1,280 vision tokens each (4 patches per token), capacity 16,384.
Where the packs do not divide by the ranks the largest are split, as a plan does. The demo is small: at 64
ranks its 58 packs become 64, one step (a partial one at grad-accum 4), so its 64-rank rows say little.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from vlm_pack.data.plan import _split_for_ranks, deal_packs
from vlm_pack.packing import StepBalance, pack, pack_costs, step_imbalance
from vlm_pack.packing.cost import gather_ragged, image_patches
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
    rows = []
    for w in worlds:
        bins = _split_for_ranks(bfd, w)
        costs, members, ptr = costs_of(table, bins)
        nbins = _split_for_ranks(nemo, w)
        ncosts = costs_of(table, nbins)[0]
        has_image = np.add.reduceat(np.diff(table.image_ptr)[members], ptr[:-1]) > 0
        for k in accums:
            shuffle = np.random.default_rng([0, 0])
            epoch = deal_packs(table, table.lengths, members, ptr, w, "epoch")[0]
            epoch = epoch[:, shuffle.permutation(epoch.shape[1])]
            t0 = time.perf_counter()
            step = deal_packs(table, table.lengths, members, ptr, w, StepBalance(grad_accum=k))[0]
            ms = (time.perf_counter() - t0) * 1e3
            steps = np.arange(len(nbins)).reshape(-1, w).T  # creation order: step s = packs s*w .. s*w+w-1
            steps = steps[:, np.random.default_rng([0, 0]).permutation(steps.shape[1])]
            short = steps_short_of_images(has_image, step, k)
            rows.append(
                f"| {name} | {w} | {k} | {len(bins)} | {-(-step.shape[1] // k)} | "
                f"{step_imbalance(costs, epoch, k):.3f} | {step_imbalance(costs, step, k):.3f} | "
                f"{step_imbalance(ncosts, steps, k):.3f} | {short['mixed']} / {short['text_only']} | {ms:.1f} |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    print(
        "| data | ranks | grad-accum | packs | steps | (a) epoch | (b) step plan | (c) nemo-style | "
        "(b) steps a rank lacks an image: mixed / all-text | (b) plan ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in run("demo (320, cap 16,384)", demo(16384), 16384, args.worlds, args.grad_accum):
        print(row)
    for row in run("llava-like (20,000, cap 16,384)", llava_like(), 16384, args.worlds, args.grad_accum):
        print(row)


if __name__ == "__main__":
    main()
