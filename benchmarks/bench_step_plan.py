"""Step plans on a mix the project never tuned on (issue 34): the image rule, no wasted step, balance.

    PYTHONPATH=. python benchmarks/bench_step_plan.py                 # 4 draws of 40,000 samples
    PYTHONPATH=. python benchmarks/bench_step_plan.py --samples 12000 --draws 0 1

Data: ``tests/test_plan_rule.py``'s ``generated_mix`` (35% text-only, 35% one image, 18% two, 12% three;
images of 256-5,000 vision tokens; text lognormal, median 400 tokens, with a 3% tail of 4,000-15,000-token
documents; capacity 16,384), one draw per seed. Each draw at 8 and 64 ranks, grad-accum 1 and 4:

    DS     the best-fit packs (split until the ranks divide them, as a plan does) dealt as PyTorch's
           ``DistributedSampler`` deals: shuffled, pack i to rank i % world_size, grad_accum consecutive
           micro-batches a step (the partial last step: fewer micro-batches)
    plan   ``StepBalance(grad_accum)`` (the default ``packs="auto"``): what ``build_plan`` trains on

Every pack costed by ``PackCost()`` (``vlm_pack.packing.cost``, Qwen2-VL-7B). imbalance: the sum over
optimizer steps of the slowest rank's cost / the mean's. short: steps where some rank has no image pack
(``steps_short_of_images``), as short / forced (steps - image packs // world_size: no dealing avoids them);
the image rule holds where short == forced. fill: the emptiest step's tokens / its rows' capacity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_plan_rule import CAPACITY, TARGET, generated_mix, plan_of

from vlm_pack.data.plan import _costs_and_images, _split_for_ranks
from vlm_pack.packing import step_imbalance
from vlm_pack.packing.steps import steps_short_of_images


def figures(table, members, bin_ptr, rank_bins, grad_accum):
    """``(optimizer steps, imbalance, steps_short_of_images, emptiest step's fill)`` of one dealing."""
    costs, images = _costs_and_images(table, np.asarray(table.lengths), members, bin_ptr, None)
    tokens = np.add.reduceat(np.asarray(table.lengths)[members], bin_ptr[:-1])
    assert np.array_equal(np.sort(members), np.arange(len(table))) and tokens.max() <= CAPACITY
    starts = np.arange(0, rank_bins.shape[1], grad_accum)
    rows = np.add.reduceat(np.ones_like(rank_bins), starts, axis=1).sum(axis=0)
    fill = np.add.reduceat(tokens[rank_bins], starts, axis=1).sum(axis=0) / (rows * CAPACITY)
    short = steps_short_of_images(images > 0, rank_bins, grad_accum)
    return starts.size, step_imbalance(costs, rank_bins, grad_accum), short, float(fill.min())


def sampler_dealing(table, world, seed=0):
    """Best-fit packs split for the ranks, dealt as DistributedSampler(shuffle=True) deals indices."""
    from vlm_pack.packing import pack

    bins = _split_for_ranks([np.asarray(b, np.int64) for b in pack(table.lengths, CAPACITY).bins], world)
    members = np.concatenate(bins)
    ptr = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(bins))
    return members, ptr, perm.reshape(-1, world).T  # [W, K / W]: rank r gets perm[r], perm[r + W], ...


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--draws", type=int, nargs="+", default=[0, 1, 2, 3])
    args = ap.parse_args()
    print(
        "| draw | ranks | grad-accum | packs DS / plan (kept) | optimizer steps DS / plan | imbalance DS / plan "
        "(target) | steps a rank lacks an image, short / forced: DS / plan | emptiest step's fill DS / plan | "
        "plan s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for draw in args.draws:
        table = generated_mix(args.samples, draw)
        for world in (8, 64):
            ds_members, ds_ptr, ds_bins = sampler_dealing(table, world, draw)
            for accum in (1, 4):
                t0 = time.perf_counter()
                plan = plan_of(table, world, accum)
                seconds = time.perf_counter() - t0
                ds = figures(table, ds_members, ds_ptr, ds_bins, accum)
                got = figures(table, np.asarray(plan.rows), np.asarray(plan.bin_ptr), np.asarray(plan.rank_bins), accum)
                kept = "bfd" if plan.num_bins == ds_ptr.size - 1 and np.array_equal(plan.rows, ds_members) else "balanced"
                print(
                    f"| {draw} | {world} | {accum} | {ds_ptr.size - 1:,} / {plan.num_bins:,} ({kept}) | {ds[0]} / "
                    f"{got[0]} | {ds[1]:.4f} / **{got[1]:.4f}** ({TARGET[world]}) | {ds[2]['short']} / "
                    f"{ds[2]['forced']}: {got[2]['short']} / {got[2]['forced']} | {ds[3]:.3f} / {got[3]:.3f} | "
                    f"{seconds:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
