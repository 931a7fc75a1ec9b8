"""Benchmark vlm_pack.forward.context_parallel against the per-sample formulations it replaces, same data, same run.

    .venv/bin/python benchmarks/bench_parallel.py                       # defaults below
    .venv/bin/python benchmarks/bench_parallel.py --samples 1000 10000 --roll-samples 16 256 --cp 4

1. ``context_parallel_index`` (one ``repeat_interleave`` over all samples) vs a Python loop that slices
   each sample's two chunks (``torch.arange`` per chunk, as a per-sample ``get_batch_on_this_cp_rank``
   would): milliseconds per rank, and the ratio loop / vectorised.
2. ``roll_packed_context_parallel`` (every sample's boundary tokens in one ``batch_isend_irecv``) vs one
   exchange per sample, over gloo with 2 processes on CPU: milliseconds per call, and the ratio.

Both peers are checked to give identical results before they are timed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_pack.forward.context_parallel import context_parallel_index, roll_packed_context_parallel


def loop_index(cu: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Per-sample reference: rank's front chunk then back chunk of every sample, one sample at a time."""
    parts = []
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        c = (end - start) // (2 * cp)
        parts.append(torch.arange(start + rank * c, start + (rank + 1) * c))
        parts.append(torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
    return torch.cat(parts)


def make_cu(n: int, cp: int, seed: int) -> torch.Tensor:
    """(n+1,) padded offsets of n samples of 2*cp*[1, 400) tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 400, (n,), generator=g) * 2 * cp
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0))


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def bench_index(samples: list[int], cp: int, repeats: int) -> None:
    for n in samples:
        cu = make_cu(n, cp, seed=n)
        for r in range(cp):
            assert torch.equal(context_parallel_index(cu, cp, r), loop_index(cu, cp, r))
        vec = best_ms(lambda cu=cu: [context_parallel_index(cu, cp, r) for r in range(cp)], repeats) / cp
        loop = best_ms(lambda cu=cu: [loop_index(cu, cp, r) for r in range(cp)], repeats) / cp
        print(
            f"index  samples={n:>6} tokens={int(cu[-1]):>9} cp={cp}: vectorised {vec:8.3f} ms/rank, "
            f"per-sample loop {loop:8.3f} ms/rank, loop/vectorised x{loop / vec:.1f}"
        )


def per_sample_roll(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """The same roll with one boundary exchange per sample."""
    cp = dist.get_world_size()
    out = torch.empty_like(x)
    local = (cu // cp).tolist()
    for a, e in itertools.pairwise(local):
        out[a:e] = roll_packed_context_parallel(x[a:e], torch.tensor([0, (e - a) * cp]), fill=-100)
    return out


def _roll_worker(rank: int, world: int, init_file: str, samples: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for n in samples:
            cu = make_cu(n, world, seed=n)
            x = torch.randint(0, 100, (int(cu[-1]) // world,), generator=torch.Generator().manual_seed(rank))
            assert torch.equal(roll_packed_context_parallel(x, cu, fill=-100), per_sample_roll(x, cu))
            times = {}
            for name, fn in (
                ("batched", lambda x=x, cu=cu: roll_packed_context_parallel(x, cu, fill=-100)),
                ("per-sample", lambda x=x, cu=cu: per_sample_roll(x, cu)),
            ):
                dist.barrier()
                times[name] = best_ms(fn, repeats)
            if rank == 0:
                print(
                    f"roll   samples={n:>6} tokens={int(cu[-1]):>9} cp={world} (gloo): batched "
                    f"{times['batched']:8.3f} ms, per-sample {times['per-sample']:8.3f} ms, "
                    f"per-sample/batched x{times['per-sample'] / times['batched']:.1f}"
                )
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[1000, 10000], help="samples for the index")
    ap.add_argument("--cp", type=int, default=4, help="context-parallel size for the index")
    ap.add_argument("--roll-samples", type=int, nargs="+", default=[16, 256], help="samples for the roll")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, best of {args.repeats}")
    bench_index(args.samples, args.cp, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _roll_worker,
            args=(2, os.path.join(tmp, "init"), args.roll_samples, args.repeats),
            nprocs=2,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
