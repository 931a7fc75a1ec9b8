"""Train a tiny Qwen2-VL with a plain PyTorch loop: pack plan -> DataLoader(batch_sampler) -> PackingCollator.

The offline recipe, step by step, on the embedded demo shards (CPU, a minute)::

    shards --(text + image headers)--> forecast lengths --pack()--> plan: bins of sample indices
                                                                        |
    DataLoader(dataset, batch_sampler=plan.bins, collate_fn=PackingCollator(capacity))
        each micro-batch = one pack = one row of `capacity` tokens, samples kept apart by position resets
                                                                        |
    model(**batch.model_inputs("sdpa"), num_items_in_batch=label tokens of the whole update)

Gradient accumulation keeps the samples per optimizer update close to the padded run it replaces
(``grad_accum = ceil(target_samples_per_update / (mean_samples_per_pack * world_size))``), and the loss is
normalised per token over the whole update, so packing changes nothing but the padding.

    python examples/train_loop.py --steps 4 --max-samples 48
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import webdataset as wds

from vlm_pack import Preprocessor, image_size, pack
from vlm_pack.data import image_fields, parse_text
from vlm_pack.demo import demo_shards
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model


def read_shards(urls: list[str], max_samples: int) -> list[dict[str, Any]]:
    """Raw samples (encoded image bytes, conversation, key) from WebDataset shards; nothing decoded."""
    out = []
    for sample in wds.WebDataset(urls, shardshuffle=False):
        out.append(
            {
                "key": sample["__key__"],
                "images": [sample[f] for f in image_fields(sample)],
                "conversation": parse_text(sample),
            }
        )
        if len(out) == max_samples:
            break
    return out


class ProcessedDataset(torch.utils.data.Dataset):
    """Map-style dataset: decodes and processes sample ``i`` when the DataLoader asks for it."""

    def __init__(self, raw: list[dict[str, Any]], pre: Preprocessor) -> None:
        self.raw, self.pre = raw, pre

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.raw[i]
        out = self.pre.process(s["images"], s["conversation"], key=s["key"])
        return {**out, "__key__": s["key"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--max-samples", type=int, default=96, help="demo samples to use")
    p.add_argument("--capacity", type=int, default=2048, help="tokens per pack")
    p.add_argument("--max-pixels", type=int, default=50176, help="image processor cap (50176: <= 64 tokens)")
    p.add_argument("--target-samples-per-update", type=int, default=8)
    p.add_argument("--world-size", type=int, default=1, help="only for the grad-accum arithmetic here")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data-dir", default=None, help="where the demo shards go (default: a cache folder)")
    p.add_argument("--num-workers", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(0)

    tokenizer = build_tokenizer("qwen2_vl")
    image_proc = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": args.max_pixels})
    pre = Preprocessor(tokenizer, image_proc)  # the forecast follows the processor's own parameters
    raw = read_shards([str(s) for s in demo_shards(args.data_dir)], args.max_samples)

    # 1. Forecast every sample's expanded length from its text and image headers (no decode), then pack.
    lengths = [
        pre.forecast(s["conversation"], [image_size(b) for b in s["images"]], key=s["key"])[0] for s in raw
    ]
    plan = pack(lengths, args.capacity, oversized="skip", shuffle_seed=0)  # shuffled pack order
    for u in plan.unpacked:
        print(f"skipped {raw[u.index]['key']}: {u.reason}")
    samples_per_pack = plan.order.size / plan.num_bins
    grad_accum = max(1, math.ceil(args.target_samples_per_update / (samples_per_pack * args.world_size)))
    print(
        f"{len(raw)} samples -> {plan.num_bins} packs of {args.capacity} tokens, efficiency {plan.efficiency:.1%}, "
        f"{samples_per_pack:.2f} samples/pack -> grad_accum {grad_accum} "
        f"(~{samples_per_pack * args.world_size * grad_accum:.1f} samples per update)"
    )

    # 2. One DataLoader batch = one pack of the plan; the collator lays it out as one row.
    model = tiny_model("qwen2_vl", tokenizer).train()
    collator = pre.collator(args.capacity, model_config=model.config)
    loader = torch.utils.data.DataLoader(
        ProcessedDataset(raw, pre),
        batch_sampler=plan.bins,
        collate_fn=collator,
        num_workers=args.num_workers,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # 3. Train: per-token loss over the whole update (num_items_in_batch), as the Trainer does.
    history: list[float] = []
    batches = iter(loader)
    for step in range(args.steps):
        group = []
        for _ in range(grad_accum):
            try:
                group.append(next(batches))
            except StopIteration:  # next epoch
                batches = iter(loader)
                group.append(next(batches))
        n_tokens = sum(b.num_label_tokens for b in group)
        t0 = time.perf_counter()
        total = 0.0
        for batch in group:
            assert batch.num_rows == 1, "the plan's packs fit one row each: the forecast is exact"
            out = model(**batch.model_inputs("sdpa"), num_items_in_batch=n_tokens)
            out.loss.backward()
            total += out.loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        real = sum(b.num_real_tokens for b in group)
        print(
            f"step {step}: loss {total:.4f}  samples {sum(b.num_samples for b in group)}  "
            f"fill {real / (len(group) * args.capacity):.1%}  {real / (time.perf_counter() - t0):,.0f} tok/s"
        )
        history.append(total)
    return {
        "losses": history,
        "grad_accum": grad_accum,
        "packs": plan.num_bins,
        "efficiency": plan.efficiency,
    }


if __name__ == "__main__":
    main()
