"""What running the token mixers per sample costs: a packed row with its mixers isolated against the same
samples unpacked (each alone, one forward + backward per sample), and against the row run whole (which leaks:
the floor the per-sample path cannot beat), on CPU at a few row lengths.

Model: a Qwen3.5 text model (``Qwen3_5ForCausalLM``: gated delta-net + attention 3:1), random init, fp32, widths
from the flags. Rows: sample lengths drawn uniformly in [L/8, L/2], packed until the row of L tokens is full.
Each mode is timed forward + backward, alternating mode by mode (--repeats, the fastest counts), so load from
other processes hits all alike. Printed per row length: ms per row, and the ratios::

    per_sample / unpacked   the isolated packed row against the samples one by one (< 1: packing pays)
    per_sample / whole      the price of isolation against the leaking whole-row run

    python benchmarks/bench_mixers.py --lengths 512 1024 2048
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from vlm_pack.forward.mixers import isolate_token_mixers


def build(args) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        linear_num_value_heads=args.hidden // 64, linear_num_key_heads=args.hidden // 128, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(args.layers)],
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.Qwen3_5ForCausalLM(cfg).train()


def row_lengths(length: int, gen: torch.Generator) -> list[int]:
    """Sample lengths in [L/8, L/2] until the row is full (the last one cut to fit)."""
    out: list[int] = []
    while sum(out) < length:
        n = int(torch.randint(length // 8, length // 2 + 1, (1,), generator=gen))
        out.append(min(n, length - sum(out)))
    return out


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(whole, isolated, lengths: list[int], ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Fastest forward + backward (s) of: the samples one by one, the isolated packed row, the whole row."""
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seq_idx = torch.cat([torch.full((n,), k, dtype=torch.int32) for k, n in enumerate(lengths)])[None]

    def packed(model, **extra):
        def go():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **extra).loss.backward()

        return go

    def unpacked():
        whole.zero_grad(set_to_none=True)
        for part in ids.split(lengths, dim=1):
            whole(input_ids=part, labels=part, use_cache=False).loss.backward()

    runs = {"unpacked": unpacked, "per_sample": packed(isolated, seq_idx=seq_idx), "whole": packed(whole)}
    for fn in runs.values():  # warm-up
        fn()
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):  # alternating, so that other processes' load hits every mode alike
        for name, fn in runs.items():
            best[name] = min(best[name], timed(fn, 1))
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    whole = build(args)
    isolated = isolate_token_mixers(build(args))
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"Qwen3.5 text, hidden {args.hidden}, {args.layers} layers (3:1 delta-net:attention), fp32 CPU, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'L':>6} {'samples':>7} {'unpacked ms':>12} {'per_sample ms':>14} {'whole ms':>9} "
          f"{'per_sample/unpacked':>20} {'per_sample/whole':>17}")  # fmt: skip
    for length in args.lengths:
        lengths = row_lengths(length, gen)
        best = measure(whole, isolated, lengths, torch.randint(0, 1024, (1, length), generator=gen), args.repeats)
        row = {"length": length, "samples": len(lengths), **{k: v * 1e3 for k, v in best.items()}}
        row["per_sample/unpacked"] = best["per_sample"] / best["unpacked"]
        row["per_sample/whole"] = best["per_sample"] / best["whole"]
        results.append(row)
        print(f"{length:>6} {len(lengths):>7} {row['unpacked']:>12.1f} {row['per_sample']:>14.1f} {row['whole']:>9.1f} "
              f"{row['per_sample/unpacked']:>20.2f} {row['per_sample/whole']:>17.2f}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
