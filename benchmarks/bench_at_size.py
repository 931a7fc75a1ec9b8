"""Packed vs padded training steps at the size people fine-tune: random-initialised models of released shapes.

The same samples (``vlm_pack.demo`` photos, documents and screenshots at real sizes, through the real Qwen image
processor; stand-in tokenizer), the same initial weights, one optimizer step after another in both modes::

    packed   vp.pack(lengths, capacity) -> PackingCollator rows -> model_inputs("flash_attention_2"):
             one flat row per micro-batch, cu_seq_lens, use_varlen_attention (token mixers isolated:
             --mixers kernel = flash-linear-attention on CUDA, per_sample = vlm-pack's per-sample loop)
    padded   the same samples, micro-batches of B (the packed rows' mean samples per row), right padding,
             attention_mask, the model's own sdpa

Both losses are HF's per-token loss with ``num_items_in_batch`` = the step's label tokens, so the first step's
loss is the same number in both modes (checked; exit 1 otherwise). Reported per mode: real tokens/s (every
non-pad token, text and vision), peak memory (CUDA max_memory_allocated), the padded batches' padding share;
and packed/padded speed against the padding bound 1 / (1 - padding share) of the same data.

Shapes: ``qwen2_5_vl_3b`` is Qwen2.5-VL-3B-Instruct's config (text 2048 x 36 layers, 16 heads / 2 KV, MLP 11008;
ViT 1280 x 32 blocks, MLP 3420); ``qwen3_5_2b`` approximates a ~2B Qwen3.5 (text 2048 x 24 layers, gated delta-net
and attention 3:1, 8 heads / 2 KV of 256, delta-net 16 key / 16 value heads of 128, MLP 6144; ViT 1024 x 24): the
released config.json was not reachable when this was written, so check it before quoting the shape. The vocabulary
is the stand-in tokenizer's (about 1,000 ids, not 151k / 248k): the LM head and its logits are far smaller than
the released models', so peak memory is the body's, not a full run's. ``tiny_*``:
the same path at a tiny size (``tests/test_bench_at_size.py`` runs it on CPU).

    python benchmarks/bench_at_size.py --model qwen2_5_vl_3b --device cuda --capacity 16384 --checkpointing
    python benchmarks/bench_at_size.py --model qwen3_5_2b --device cuda --capacity 16384 --checkpointing --mixers kernel
    python benchmarks/bench_at_size.py --model tiny_qwen3_5 --device cpu --capacity 1024 --samples 8 --steps 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import vlm_pack as vp
from vlm_pack import offline
from vlm_pack.collate.labels import IGNORE_INDEX
from vlm_pack.collate.padded import pad_samples
from vlm_pack.demo import demo_records
from vlm_pack.forward import mixers

TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "templates"
_QWEN35_TEXT = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=256, intermediate_size=6144, linear_num_key_heads=16, linear_num_value_heads=16,
                    linear_key_head_dim=128, linear_value_head_dim=128,
                    layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)])  # fmt: skip
#: name -> (family, text config edits, vision config edits)
SHAPES: dict[str, tuple[str, dict, dict]] = {
    "qwen2_5_vl_3b": ("qwen2_5_vl",
                      dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                           intermediate_size=11008, layer_types=["full_attention"] * 36),
                      dict(hidden_size=1280, depth=32, intermediate_size=3420, num_heads=16, out_hidden_size=2048)),
    "qwen3_5_2b": ("qwen3_5", _QWEN35_TEXT,
                   dict(hidden_size=1024, depth=24, intermediate_size=4096, num_heads=16, out_hidden_size=2048)),
    "tiny_qwen2_5_vl": ("qwen2_5_vl", {}, {}),
    "tiny_qwen3_5": ("qwen3_5", {}, {}),
}  # fmt: skip


def model_config(name: str, tokenizer: Any) -> Any:
    """The transformers config of shape ``name`` whose token ids match ``tokenizer``."""
    family, text, vision = SHAPES[name]
    config = offline.tiny_model_config(family, tokenizer, num_layers=4)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    if name == "qwen2_5_vl_3b":
        config.vision_config.fullatt_block_indexes = [7, 15, 23, 31]
    return type(config).from_dict(config.to_dict())  # re-validated as one config


def build_model(name: str, tokenizer: Any, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    config = model_config(name, tokenizer)
    torch.manual_seed(seed)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).train()


def preprocessor(name: str, max_pixels: int) -> vp.Preprocessor:
    family = SHAPES[name][0]
    template = (TEMPLATES / f"{family}.jinja").read_text()
    proc = offline.processor(family, offline.build_tokenizer(family), chat_template=template,
                             size={"shortest_edge": 4 * 28 * 28, "longest_edge": max_pixels})  # fmt: skip
    return vp.Preprocessor(processor=proc)


def load_samples(pre: vp.Preprocessor, count: int, capacity: int) -> tuple[list[dict], int]:
    """Processed demo samples (images at their real sizes, capped by the processor's pixel budget) that fit
    ``capacity``; and how many did not."""
    out, too_long = [], 0
    for record in demo_records(count):
        sample = pre.process([data for data, _ in record["images"]], record["conversation"], record["key"])
        if len(sample["input_ids"]) > capacity:
            too_long += 1
            continue
        out.append(sample)
    return out, too_long


def step_batches(samples: list[dict], pre: vp.Preprocessor, capacity: int, model_config: Any) -> dict[str, list]:
    """The step's micro-batches in both modes: packed rows (flash style) and padded groups of B samples."""
    lengths = [len(s["input_ids"]) for s in samples]
    bins = vp.pack(lengths, capacity=capacity).bins
    collator = pre.collator(capacity, model_config=model_config, pad_to_capacity=False)
    packed = [collator([samples[i] for i in b]).model_inputs("flash_attention_2") for b in bins]
    per_row = max(1, round(len(samples) / len(bins)))
    order = [i for b in bins for i in b]  # the same samples in the same order
    padded = []
    for start in range(0, len(order), per_row):
        group = [samples[i] for i in order[start : start + per_row]]
        inputs = pad_samples(group, pad_token_id=collator.pad_token_id)
        inputs["labels"] = torch.nn.utils.rnn.pad_sequence([s["labels"] for s in group], batch_first=True,
                                                           padding_value=IGNORE_INDEX)  # fmt: skip
        padded.append(inputs)
    return {"packed": packed, "padded": padded}


def _move(inputs: dict, device: str, dtype: torch.dtype) -> dict:
    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device, dtype=dtype if v.is_floating_point() else None)
        return v

    return {k: one(v) for k, v in inputs.items()}


def run_step(model, batches: list[dict], device: str, dtype: torch.dtype, optimizer) -> float:
    """One optimizer step over ``batches``; returns the step's per-token loss."""
    items = sum(int((b["labels"][..., 1:] != IGNORE_INDEX).sum()) for b in batches)
    total = 0.0
    for batch in batches:
        kwargs = {k: v for k, v in _move(batch, device, dtype).items() if k != "use_cache"}
        loss = model(**kwargs, use_cache=False, num_items_in_batch=items).loss
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def real_tokens(batches: list[dict], mode: str) -> tuple[int, int]:
    """(real tokens, computed tokens) of a step's micro-batches."""
    if mode == "padded":
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        return real, sum(b["input_ids"].numel() for b in batches)
    real = sum(int(b["cu_seq_lens_q"][-1]) for b in batches)  # padding after a sample is its own
    return real, sum(b["input_ids"].numel() for b in batches)


def measure(args, mode: str, steps: list[dict], tokenizer) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, tokenizer, dtype, args.device)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "packed":
        vp.use_varlen_attention(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, seconds, real, computed = [], 0.0, 0, 0
    for i, step in enumerate(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(run_step(model, step[mode], args.device, dtype, optimizer))
        if cuda:
            torch.cuda.synchronize()
        if i > 0 or len(steps) == 1:  # the first step warms up, unless it is the only one
            seconds += time.perf_counter() - t0
            r, c = real_tokens(step[mode], mode)
            real, computed = real + r, computed + c
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    mixer_paths = sorted({m.isolation for m in mixers.find_token_mixers(model)})
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return dict(mode=mode, tokens_per_s=real / seconds, padding_share=1 - real / computed, peak_gib=peak,
                first_loss=losses[0], micro_batches=len(steps[0][mode]), mixers=mixer_paths)  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny_qwen3_5")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--capacity", type=int, default=16384)
    p.add_argument("--rows", type=int, default=2, help="packed rows per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first warms up)")
    p.add_argument("--samples", type=int, default=160, help="demo records to draw from")
    p.add_argument("--max-pixels", type=int, default=1280 * 28 * 28)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--mixers", choices=["kernel", "per_sample"], default="kernel",
                   help="token mixers of the packed mode: flash-linear-attention where it runs, or per sample")  # fmt: skip
    p.add_argument("--loss-tol", type=float, default=0.0, help="first-step loss tolerance (default by dtype)")
    args = p.parse_args(argv)
    pre = preprocessor(args.model, args.max_pixels)
    samples, too_long = load_samples(pre, args.samples, args.capacity)
    config = model_config(args.model, pre.tokenizer)
    lengths = [len(s["input_ids"]) for s in samples]
    bins = vp.pack(lengths, capacity=args.capacity).bins
    steps, used = [], 0
    for _ in range(args.steps):  # each step: the next --rows packed rows' samples
        take = bins[used : used + args.rows]
        if len(take) < args.rows:
            break
        used += args.rows
        chosen = [samples[i] for b in take for i in b]
        steps.append(step_batches(chosen, pre, args.capacity, config))
    if not steps:
        sys.exit(f"not enough samples for one step of {args.rows} rows of {args.capacity}: raise --samples")
    result: dict[str, Any] = dict(model=args.model, device=args.device, dtype=args.dtype, capacity=args.capacity,
                                  steps=len(steps), too_long=too_long, mixers_flag=args.mixers)  # fmt: skip
    kernel_device = mixers._kernel_device
    if args.mixers == "per_sample":  # vlm-pack's per-sample loop even where the kernels would run
        mixers._kernel_device = lambda hidden: False
    try:
        for mode in ("padded", "packed"):
            result[mode] = measure(args, mode, steps, pre.tokenizer)
    finally:
        mixers._kernel_device = kernel_device
    speedup = result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"]
    bound = 1 / (1 - result["padded"]["padding_share"])
    tol = args.loss_tol or (5e-3 if args.dtype in ("bfloat16", "float16") else 1e-4)
    gap = abs(result["packed"]["first_loss"] - result["padded"]["first_loss"])
    result.update(speedup=speedup, padding_bound=bound, of_bound=speedup / bound, first_loss_gap=gap,
                  losses_equal=gap <= tol * max(1.0, abs(result["padded"]["first_loss"])))  # fmt: skip
    for mode in ("padded", "packed"):
        r = result[mode]
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
        print(f"{mode:>7}: {r['tokens_per_s']:9.0f} real tok/s  padding {r['padding_share']:.3f}  peak {peak}  "
              f"first loss {r['first_loss']:.5f}  micro-batches {r['micro_batches']}  mixers {r['mixers']}")  # fmt: skip
    print(f"packed / padded {speedup:.2f}x, padding bound {bound:.2f}x: {speedup / bound:.2f} of the bound; "
          f"first-step loss gap {gap:.2e} ({'equal' if result['losses_equal'] else 'DIFFERENT'})")  # fmt: skip
    print(json.dumps(result))
    if not result["losses_equal"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
