"""Speed of the packing collator and of the cu_seqlens remap, against peers measured in the same run.

1. Collating 64 preprocessed Qwen2-VL samples (real image processor, 1-4 images each, up to 256 vision
   tokens per image) into rows of 8192 tokens with ``PackingCollator`` (packing, labels, 4-row mRoPE ids,
   vision tensors, cu_seqlens), against
   - the usual way to get Qwen-VL packed positions: the model's own ``get_rope_index`` per sample, plus
     concatenation of ids, positions, grids and pixel_values (what training scripts do in their collate
     function), and
   - transformers' ``DataCollatorWithFlattening`` on the same samples (text fields only, 1-D positions:
     the simplest padding-free collator, which gets Qwen-VL positions wrong).
   Concatenating ``pixel_values`` (memory-bound, any collator pays it) is also timed alone, and the
   collator once more on the samples without ``pixel_values``: its own work.
2. Remapping the ``cu_seqlens`` of a collapsed 128k-token row holding 1,000 images (64 samples, counts
   1-4096 per image) with ``remap_cu_seqlens`` (target: < 1 ms on CPU), against a plain Python loop over
   the tokens and a per-sample torch loop (the shape of Megatron-LM PR 3427's remap).

Run: ``.venv/bin/python benchmarks/bench_collate.py [--repeats 30]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from PIL import Image

from vlm_pack.collate.collator import PackingCollator
from vlm_pack.collate.remap import remap_cu_seqlens, remap_cu_seqlens_padded
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model
from vlm_pack.processing import process_sample

IMG = -200


def timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def qwen_samples(n: int, seed: int = 0):
    rng = random.Random(seed)
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 448 * 448})
    words = "the a picture of red dog cat near house tree sky what is shown describe compare count".split()
    samples = []
    for _ in range(n):
        images = [
            Image.new(
                "RGB",
                (rng.randrange(56, 448), rng.randrange(56, 448)),
                tuple(rng.randrange(256) for _ in range(3)),
            )
            for _ in range(rng.randrange(1, 5))
        ]
        question = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 40)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 120)))
        conv = [
            {
                "role": "user",
                "content": [*({"type": "image"} for _ in images), {"type": "text", "text": question}],
            },
            {"role": "assistant", "content": answer},
        ]
        samples.append(process_sample(images, conv, tokenizer=tok, image_processor=ip, family="qwen2_vl"))
    return tok, samples


def bench_collate(repeats: int) -> None:
    from transformers import DataCollatorWithFlattening

    tok, samples = qwen_samples(64)
    model = tiny_model("qwen2_vl", tok)
    lens = [s["input_ids"].numel() for s in samples]
    # max_rows=None: 64 samples packed inside the collator (in-batch packing), as the figures always measured
    collator = PackingCollator(
        8192, tokenizer=tok, model_config=model.config, pad_to_multiple_of=8, max_rows=None
    )
    batch = collator(samples)
    flattening = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    text_only = [{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in samples]

    def per_sample_get_rope_index():
        ids, pos, grids = [], [], []
        for s in samples:
            p, _ = model.model.get_rope_index(
                s["input_ids"][None],
                mm_token_type_ids=s["mm_token_type_ids"][None],
                image_grid_thw=s["image_grid_thw"],
            )
            ids.append(s["input_ids"])
            pos.append(p[:, 0])
            grids.append(s["image_grid_thw"])
        return (
            torch.cat(ids),
            torch.cat(pos, 1),
            torch.cat(grids),
            torch.cat([s["pixel_values"] for s in samples]),
        )

    no_pixels = [{k: v for k, v in s.items() if k != "pixel_values"} for s in samples]
    n_img = int(batch.image_grid_thw.shape[0])
    print(
        f"collate 64 Qwen2-VL samples ({sum(lens):,} tokens, {n_img} images, pixel_values "
        f"{tuple(batch.pixel_values.shape)} = {batch.pixel_values.numel() * 4 / 2**20:.0f} MiB) into "
        f"{batch.num_rows} rows of 8192, pad to 8; median of {repeats} calls"
    )
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        t_all = timed(lambda: collator(samples), repeats)
        t_cat = timed(lambda: torch.cat([s["pixel_values"] for s in samples]), repeats)
        t_ours = timed(lambda: collator(no_pixels), repeats)
        t_rope = timed(per_sample_get_rope_index, max(3, repeats // 3))
        t_flat = timed(lambda: flattening(text_only), repeats)
        print(f"\ntorch threads = {threads}")
        print(f"{'collator':62s} {'ms/batch':>9s} {'samples/s':>10s} {'vs ours':>8s}")
        for name, t in (
            ("PackingCollator, everything (incl. pixel_values)", t_all),
            ("  torch.cat(pixel_values) alone (memory-bound; every collator)", t_cat),
            ("PackingCollator without pixel_values (ours)", t_ours),
            ("per-sample model.get_rope_index + cat (no pixel_values)", t_rope),
            ("HF DataCollatorWithFlattening (text fields only, 1-D pos)", t_flat),
        ):
            print(f"{name:62s} {t * 1e3:9.2f} {64 / t:10,.0f} {t / t_ours:7.2f}x")
    torch.set_num_threads(default_threads)


def collapsed_row(total: int, n_images: int, n_samples: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (total,), generator=g)
    pos = torch.randperm(total, generator=g)[:n_images]
    ids[pos] = IMG
    counts = torch.randint(1, 4097, (n_images,), generator=g)
    cuts = torch.sort(torch.randperm(total - 1, generator=g)[: n_samples - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(torch.int32)
    return ids, counts, cu


def python_loop(cu: list[int], ids: list[int], counts: list[int]) -> list[int]:
    expanded_at, pos, k = [], 0, 0
    for tok in ids:
        expanded_at.append(pos)
        if tok == IMG:
            pos += counts[k]
            k += 1
        else:
            pos += 1
    expanded_at.append(pos)
    return [expanded_at[c] for c in cu]


def per_sample_loop(cu: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # One sample at a time: count its placeholders, add their extra embeddings (Megatron PR 3427's shape).
    out = [0]
    k = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = int((ids[a:b] == IMG).sum())
        out.append(out[-1] + (b - a) + int((counts[k : k + n] - 1).sum()))
        k += n
    return torch.tensor(out, dtype=cu.dtype)


def bench_remap(repeats: int) -> None:
    ids, counts, cu = collapsed_row(131072, 1000, 64)
    ref = python_loop(cu.tolist(), ids.tolist(), counts.tolist())
    assert remap_cu_seqlens(cu, ids, IMG, counts).tolist() == ref
    assert per_sample_loop(cu, ids, counts).tolist() == ref
    ids_l, counts_l, cu_l = ids.tolist(), counts.tolist(), cu.tolist()
    print(
        f"remap cu_seqlens: collapsed row of {ids.numel():,} tokens, 1,000 images (counts 1-4096, "
        f"{int(counts.sum()):,} embeddings), 64 samples; median of {repeats * 10} calls"
    )
    default_threads = torch.get_num_threads()
    # DataLoader workers run torch with one thread; the main process with all cores.
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        t_checked = timed(lambda: remap_cu_seqlens(cu, ids, IMG, counts), repeats * 10)
        t_fast = timed(lambda: remap_cu_seqlens(cu, ids, IMG, counts, validate=False), repeats * 10)
        t_padded = timed(
            lambda: remap_cu_seqlens_padded(cu, cu, ids, IMG, counts, validate=False), repeats * 10
        )
        t_samples = timed(lambda: per_sample_loop(cu, ids, counts), repeats)
        t_loop = timed(lambda: python_loop(cu_l, ids_l, counts_l), max(3, repeats // 3))
        print(f"\ntorch threads = {threads}")
        print(f"{'method':52s} {'ms':>9s} {'vs ours':>9s}")
        for name, t in (
            ("remap_cu_seqlens (validated, CPU default)", t_checked),
            ("remap_cu_seqlens(validate=False)", t_fast),
            ("remap_cu_seqlens_padded(validate=False)", t_padded),
            ("per-sample torch loop (Megatron PR 3427 shape)", t_samples),
            ("plain Python loop over tokens", t_loop),
        ):
            print(f"{name:52s} {t * 1e3:9.3f} {t / t_checked:8.1f}x")
        verdict = "met" if t_checked < 1e-3 else "NOT met"
        print(f"target < 1 ms on CPU: {verdict} ({t_checked * 1e3:.3f} ms validated)")
    torch.set_num_threads(default_threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads by default")
    bench_remap(args.repeats)
    print()
    bench_collate(args.repeats)


if __name__ == "__main__":
    main()
