"""Step balance of streaming ranks: what a look-ahead window reaches without moving data between ranks.

    PYTHONPATH=. python benchmarks/bench_stream_balance.py

Each of ``world`` ranks streams its own share of the data, as ``PackedWebDataset`` does (shards dealt at
random, so each rank reads an independent draw of the mix), and packs it online with ``StreamPacker`` (the
dataset's defaults: capacity 16,384, 256 open bins, ``min_fill_ratio`` 0.95). Every pack is costed by
:class:`vlm_pack.packing.PackCost` (Qwen2-VL-7B). A step is ``grad_accum`` micro-batches (one pack each) per
rank; the steps counted are those every rank reaches (the shortest rank's packs). Orders compared:

today     the packs in the order the packer emits them (``PackedWebDataset`` without ``balance``).
window W  ``StreamBalance(grad_accum, window_steps)``: every rank holds ``W = window_steps * grad_accum`` packs
          and emits them in the order of the shared cost-quantile schedule (``vlm_pack.packing.window``), image
          packs first at the first micro-step of each step.
plan      reference, not reachable by streaming: the map-style step plan over all ranks' packs (it moves packs
          between ranks), ``step_plan``.

Metric: sum over steps of the slowest rank's cost / sum over steps of the mean rank's cost (``step_imbalance``;
1.0: no rank waits); and the steps in which some rank has no image pack while another has one ("mixed": DDP
unused parameters / FSDP hang unless handled) and in which no rank has one ("all-text", harmless).

Data: (1) LLaVA-like synthetic mix (``bench_step_balance.llava_like``: 15% text-only, 70% one image, 15% two,
text lognormal median 250 tokens, images 64-1,280 vision tokens): 3,000 samples per rank, about 200 packs per
rank; (2) the embedded demo set (320 samples, forecast with the offline Qwen2-VL parts), drawn with replacement
to 3,000 samples per rank (it is too small for one window per rank otherwise).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_step_balance import Table, demo, llava_like

from vlm_pack.packing import StreamPacker, pack_costs, step_imbalance, step_plan
from vlm_pack.packing.cost import gather_ragged, image_patches
from vlm_pack.packing.steps import steps_short_of_images
from vlm_pack.packing.window import reserved_positions, window_order, window_schedule

CAPACITY = 16_384


def take(table: Table, rows: np.ndarray) -> Table:
    """The samples ``rows`` of ``table`` (with their images), as a new table."""
    image_tokens, ptr = gather_ragged(table.image_tokens, table.image_ptr, rows)
    return Table(table.lengths[rows], ptr, image_tokens, table.num_patches[rows])


def stream_packs(table: Table, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """One rank's stream: (pack costs float ``[B]``, has_image bool ``[B]``) in the packer's emission order."""
    packer = StreamPacker(capacity, oversized="skip")  # text-heavy at 4,096: the few longer samples left out
    lengths = table.lengths.tolist()
    bins = packer.add_many(range(len(lengths)), lengths) + packer.flush()
    members = np.concatenate([np.asarray(b.keys, np.int64) for b in bins])
    ptr = np.concatenate([[0], np.cumsum([len(b.keys) for b in bins])]).astype(np.int64)
    patches = image_patches(table.image_ptr, table.image_tokens, table.vision_tokens, table.num_patches)
    patches, image_ptr = gather_ragged(patches, table.image_ptr, members)
    costs = pack_costs(table.lengths[members], ptr, patches, image_ptr)
    has_image = np.add.reduceat(np.diff(table.image_ptr)[members], ptr[:-1]) > 0
    return costs, has_image


def windowed(
    costs: np.ndarray, has_image: np.ndarray, grad_accum: int, window: int, images: bool = True, seed: int = 0
) -> np.ndarray:
    """int64 ``[B]``: the emission order of one rank's packs with a look-ahead window of ``window`` packs
    (``images``: with the image rule, as ``StreamBalance(image_every_rank=True)``)."""
    out = []
    reserved = reserved_positions(window, grad_accum) if images else None
    for number, start in enumerate(range(0, costs.size, window)):
        part = slice(start, start + window)
        schedule = window_schedule(window, (seed, 0, 0, number))
        out.append(start + window_order(costs[part], schedule, has_image=has_image[part], reserved=reserved))
    return np.concatenate(out)


def measure(ranks: list[tuple[np.ndarray, np.ndarray]], grad_accum: int, orders: list[np.ndarray]):
    """(imbalance, mixed steps, all-text steps, steps) over the steps every rank reaches."""
    steps = min(c.size for c, _ in ranks) // grad_accum
    micro = steps * grad_accum
    offsets = np.concatenate([[0], np.cumsum([c.size for c, _ in ranks])])
    costs = np.concatenate([c for c, _ in ranks])
    image = np.concatenate([h for _, h in ranks])
    rank_bins = np.stack([offsets[r] + order[:micro] for r, order in enumerate(orders)])
    short = steps_short_of_images(image, rank_bins, grad_accum)
    return step_imbalance(costs, rank_bins, grad_accum), short["mixed"], short["text_only"], steps


def plan_reference(ranks: list[tuple[np.ndarray, np.ndarray]], grad_accum: int) -> float:
    costs = np.concatenate([c for c, _ in ranks])
    image = np.concatenate([h for _, h in ranks])
    keep = costs.size - costs.size % len(ranks)
    plan = step_plan(costs[:keep], len(ranks), grad_accum, has_image=image[:keep])
    return step_imbalance(costs[:keep], plan, grad_accum)


def run(
    name: str, table: Table, capacity: int, world: int, per_rank: int, accums: list[int], windows: list[int]
) -> list[str]:
    rng = np.random.default_rng([world, 7])
    draw = rng.permutation(table.lengths.size) if table.lengths.size >= world * per_rank else None
    ranks = []
    for r in range(world):
        rows = draw[r * per_rank : (r + 1) * per_rank] if draw is not None else rng.integers(table.lengths.size, size=per_rank)
        ranks.append(stream_packs(take(table, rows), capacity))
    rows = []
    for k in accums:
        today = measure(ranks, k, [np.arange(c.size) for c, _ in ranks])
        cells = [f"{today[0]:.3f} ({today[1]} / {today[2]})"]
        ms = 0.0
        for steps in windows:
            t0 = time.perf_counter()
            orders = [windowed(c, h, k, steps * k) for c, h in ranks]
            ms = max(ms, (time.perf_counter() - t0) * 1e3 / world)
            got = measure(ranks, k, orders)
            cells.append(f"{got[0]:.3f} ({got[1]} / {got[2]})")
        got = measure(ranks, k, [windowed(c, h, k, windows[len(windows) // 2] * k, images=False) for c, h in ranks])
        cells.append(f"{got[0]:.3f} ({got[1]} / {got[2]})")
        packs = int(np.mean([c.size for c, _ in ranks]))
        rows.append(
            f"| {name} | {world} | {k} | {packs} | {today[3]} | " + " | ".join(cells)
            + f" | {plan_reference(ranks, k):.3f} | {ms:.1f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--window-steps", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--per-rank", type=int, default=3000, help="samples each rank streams")
    ap.add_argument("--no-demo", action="store_true")
    args = ap.parse_args()
    heads = " | ".join(f"window {s} steps" for s in args.window_steps)
    middle = args.window_steps[len(args.window_steps) // 2]
    print(
        f"| data | ranks | grad-accum | packs per rank | steps | today | {heads} | window {middle} steps, no image "
        "rule | plan (moves packs) | order ms per rank |"
    )
    print("|---" * (9 + len(args.window_steps)) + "|")
    mix = llava_like(max(args.worlds) * args.per_rank * 2)
    datasets = [("llava-like", take(mix, np.arange(max(args.worlds) * args.per_rank)), CAPACITY)]
    # text-heavy: every text-only sample of the mix, then image samples until they are 40%; small packs
    text_only = np.flatnonzero(np.diff(mix.image_ptr) == 0)
    with_image = np.flatnonzero(np.diff(mix.image_ptr) > 0)[: int(text_only.size * 2 / 3)]
    heavy = np.random.default_rng(1).permutation(np.concatenate([text_only, with_image]))
    datasets.append(("text-heavy (60% text-only, cap 4,096)", take(mix, heavy), 4096))
    if not args.no_demo:
        datasets.append(("demo (drawn)", demo(CAPACITY), CAPACITY))
    for name, table, capacity in datasets:
        for world in args.worlds:
            for row in run(name, table, capacity, world, args.per_rank, args.grad_accum, args.window_steps):
                print(row, flush=True)


if __name__ == "__main__":
    main()
