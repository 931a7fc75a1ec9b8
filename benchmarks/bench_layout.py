"""Linear at any size (issue 39): from lengths to every item's bin of a ``PackedMapDataset`` epoch.

    PYTHONPATH=. python benchmarks/bench_layout.py                       # 10k, 100k and 1M packs
    PYTHONPATH=. python benchmarks/bench_layout.py --packs 10000 100000

Data: text-only samples of 300-1,700 tokens (uniform, seed 0), about 4 a pack at capacity 4,096, so
``--packs N`` plans ~4N samples; 8 ranks, ``shuffle_seed=0`` (the epoch's order is a permutation of each rank's
packs). A ``datasets.Dataset`` of that many rows stands behind the plan (the dataset class needs one; no row is
read). Columns:

    plan      lengths -> Plan (``plan_from_lengths``: best fit, dealt to ranks by step balance)
    bin_of    every item's bin through ``PackedMapDataset.bin_of``, item by item, as TRL's ``packed_dataset``
              lays out its rows and as ``__getitem__`` finds its pack: the epoch's order computed once
    vector    ``PackedMapDataset.bins_in_order()``: the same bins in one numpy step
    old       the cost of the previous ``bin_of``, which recomputed the epoch's permutation on every call:
              measured on a sample of calls and multiplied out to every item (the peer; not run in full: at
              1M packs it takes hours)
    ratio     old / bin_of

Times per pack are wall-clock microseconds, the best of 3 runs (``plan``: one run).
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

CAPACITY, WORLD = 4096, 8


def _table(n: int):
    from vlm_pack.data.forecast import LengthTable

    text = np.random.default_rng(0).integers(300, 1700, n).astype(np.int64)
    return LengthTable(
        keys=[str(i) for i in range(n)], sources=["generated"] * n, text_tokens=text,
        vision_tokens=np.zeros(n, np.int64), num_patches=np.zeros(n, np.int64),
        image_ptr=np.zeros(n + 1, np.int64), image_tokens=np.zeros(0, np.int64),
        image_starts=np.zeros(0, np.int64), index=np.arange(n, dtype=np.int64),
    )  # fmt: skip


def _best(fn, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def run(packs: int) -> dict[str, float]:
    import datasets

    from vlm_pack import PackingConfig, Preprocessor
    from vlm_pack.data.map_style import PackedMapDataset
    from vlm_pack.data.plan import plan_from_lengths
    from vlm_pack.offline import build_tokenizer, image_processor

    n = 4 * packs
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"caption": np.full(n, "x").tolist()})
    pre = Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))
    config = PackingConfig(capacity=CAPACITY, shuffle_seed=0)
    table = _table(n)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_from_lengths(table, config, world_size=WORLD, dataset=ds, preprocessor=pre)
    plan_s = time.perf_counter() - started
    packed = PackedMapDataset(ds, pre, config, plan=plan, world_size=WORLD)
    items = len(packed)

    def layout() -> None:
        packed.__dict__.pop("_order", None)  # each run computes the epoch's order again, once
        bin_of = packed.bin_of
        for item in range(items):
            bin_of(item)

    def vector() -> None:
        packed.__dict__.pop("_order", None)
        packed.bins_in_order()

    per_item = _best(layout)
    vectorised = _best(vector)
    assert packed.bins_in_order().tolist() == [packed.bin_of(i)[2] for i in range(items)]

    # the peer: the old bin_of, the epoch's order computed on each call (then one lookup)
    sample = max(20, min(2000, 2_000_000 // max(1, packed.steps)))
    rng = np.random.default_rng(1)
    picks = rng.integers(0, items, sample).tolist()

    def old_calls() -> None:
        for item in picks:
            rank, step = item % WORLD, item // WORLD
            int(packed.plan.rank_bins[rank, packed._compute_order(1)[step]])

    old = _best(old_calls) / sample * items
    return {"packs": plan.num_bins, "items": items, "plan": plan_s, "bin_of": per_item, "vector": vectorised,
            "old": old}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    print(f"{'packs':>10} {'plan s':>8} {'plan us/pack':>13} {'bin_of s':>9} {'us/pack':>8} {'vector s':>9} "
          f"{'old s (est.)':>13} {'old us/pack':>12} {'ratio':>9}")  # fmt: skip
    for target in args.packs:
        r = run(target)
        n = r["items"]
        print(
            f"{r['packs']:>10,} {r['plan']:>8.2f} {r['plan'] / n * 1e6:>13.1f} {r['bin_of']:>9.3f} "
            f"{r['bin_of'] / n * 1e6:>8.2f} {r['vector']:>9.4f} {r['old']:>13.1f} {r['old'] / n * 1e6:>12.1f} "
            f"{r['old'] / r['bin_of']:>8.0f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
