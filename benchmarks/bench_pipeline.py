"""Throughput of the WebDataset -> packed-batch pipeline, and where its time goes.

Writes ``--samples`` image-text samples into tar shards (photo-like JPEGs of --min-side..--max-side pixels,
0-2 per sample, captions and conversations), then streams them with ``--workers`` DataLoader workers through:

    vlm-pack          PackedDataLoader(PackedWebDataset(...)): header forecast, StreamPacker, decode +
                      preprocess of the packed samples (HF image processor), PackingCollator
    per-sample peer   webdataset.WebDataset(urls) -> process_sample per sample (decode + preprocess; no
                      packing, no collation): the work any VLM loader does anyway
    in-batch peer     the same, then PackingCollator over groups of consecutive samples (pack what a fixed
                      batch holds, the usual way without a streaming packer)

Reported: samples/s (wall, best of --repeats), CPU of the worker processes per sample (user + sys, every
thread, from getrusage: robust to other load on the machine) against the peers, and the CPU time of each
phase inside the workers: vlm-pack's own (forecast = text parse + tokenize + image header + token rule,
pack, collate, state snapshot) vs image decode + preprocessing and tar reading. The part of ``collate``
that is only concatenating ``pixel_values`` into one fresh tensor is measured apart. Target: own share < 10%.

    .venv/bin/python benchmarks/bench_pipeline.py --samples 256 --workers 2
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import multiprocessing.sharedctypes
import random
import resource
import tempfile
import time
import warnings

import torch
from PIL import Image, ImageDraw, ImageFilter

import vlm_pack.collate as vlm_collate
from vlm_pack.collate import PackingCollator
from vlm_pack.data.pipeline import PackedDataLoader, PackedWebDataset
from vlm_pack.data.shards import image_fields, parse_text, write_shards
from vlm_pack.data.stats import OWN_PHASES, PHASES
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.processing import process_sample

WORDS = "the a dog cat car red blue sky tree house street person sign water building left right".split()


def photo(width: int, height: int, rng: random.Random) -> bytes:
    """A JPEG with smooth regions and edges (compresses and decodes like a photo, unlike noise)."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, width // 2 + 2), y0 + rng.randrange(1, height // 2 + 2)
        draw.ellipse((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    image = image.filter(ImageFilter.GaussianBlur(1))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def records(n: int, min_side: int, max_side: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_images = rng.choice([0, 1, 1, 1, 2])
        images = [
            photo(rng.randint(min_side, max_side), rng.randint(min_side, max_side), rng)
            for _ in range(n_images)
        ]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 300)))
        if i % 2:
            out.append({"images": images, "caption": text})
        else:
            question = [{"type": "image"}] * n_images + [{"type": "text", "text": "Describe it."}]
            out.append(
                {
                    "images": images,
                    "conversation": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": text},
                    ],
                }
            )
    return out


def peer_loader(urls: list[str], tok, ip, family: str, batch: int = 0, capacity: int = 0):
    """Baselines without streaming packing: webdataset samples -> process_sample, one by one, or in
    groups of ``batch`` consecutive samples collated by the same PackingCollator (in-batch packing)."""
    import webdataset as wds

    def process(sample):
        images = [sample[f] for f in image_fields(sample)]
        return process_sample(images, parse_text(sample), tokenizer=tok, image_processor=ip, family=family)

    ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node).map(process)
    if batch:
        collator = PackingCollator(capacity, tokenizer=tok, family=family, pad_to_capacity=True)
        ds = ds.batched(batch, collation_fn=collator, partial=True)
    return ds


def instrument_concat() -> multiprocessing.sharedctypes.Synchronized:
    """CPU seconds the collator spends concatenating vision tensors (pixel_values ...) into one fresh
    tensor, summed over the DataLoader workers (forked after this call): pure data movement, apart."""
    total = multiprocessing.Value("d", 0.0)
    inner = vlm_collate._concat_vision

    def timed_concat(*args, **kwargs):
        t0 = time.thread_time()
        out = inner(*args, **kwargs)
        with total.get_lock():
            total.value += time.thread_time() - t0
        return out

    vlm_collate._concat_vision = timed_concat
    return total


def children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (the DataLoader workers, all threads)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(make_loader, repeats: int) -> tuple[float, int, float]:
    """Best wall time over ``repeats`` full passes, the number of items of a pass, and the least CPU time
    of its workers (robust to other processes on the machine, unlike the wall time)."""
    best, n, cpu = float("inf"), 0, float("inf")
    for _ in range(repeats):
        c0, t0 = children_cpu(), time.perf_counter()
        n = sum(1 for _ in make_loader())
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, children_cpu() - c0)
    return best, n, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--family", default="qwen2_vl")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--min-side", type=int, default=224)
    ap.add_argument("--max-side", type=int, default=768)
    ap.add_argument("--per-shard", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="passes per loader; the best is reported")
    args = ap.parse_args()
    torch.set_num_threads(1)

    tok, ip = build_tokenizer(args.family), image_processor(args.family)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        urls = write_shards(records(args.samples, args.min_side, args.max_side), tmp, maxcount=args.per_shard)
        print(
            f"{args.samples} samples in {len(urls)} shards written in {time.perf_counter() - t0:.1f}s; "
            f"{args.family}, capacity {args.capacity}, {args.workers} workers"
        )

        # warm both paths once (imports, tokenizer caches) outside the timings
        list(torch.utils.data.DataLoader(peer_loader(urls[:1], tok, ip, args.family), batch_size=None))

        def packed():
            ds = PackedWebDataset(
                urls,
                tokenizer=tok,
                image_processor=ip,
                capacity=args.capacity,
                family=args.family,
                shuffle_seed=0,
            )
            packed.ds = ds
            return PackedDataLoader(ds, num_workers=args.workers)

        def peer(batch: int = 0):
            return lambda: torch.utils.data.DataLoader(
                peer_loader(urls, tok, ip, args.family, batch, args.capacity),
                batch_size=None,
                num_workers=args.workers,
            )

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the benchmark data has no bad samples
            t_pack, n_packs, cpu_pack = timed(packed, args.repeats)
            concat = instrument_concat()
            timed(packed, 1)  # once more, measuring the pixel concatenation inside the collator
            concat = concat.value
        stats = packed.ds.stats
        t_peer, n_peer, cpu_peer = timed(peer(), args.repeats)
        per_batch = max(1, round(args.samples / n_packs))
        t_batch, _, cpu_batch = timed(peer(per_batch), args.repeats)

    assert stats.samples_packed == n_peer == args.samples, (stats.samples_packed, n_peer)
    rate = stats.samples_packed / t_pack
    print(
        f"vlm-pack pipeline     : {rate:7.1f} samples/s, {n_packs / t_pack:.2f} packs/s ({n_packs} packs, fill "
        f"{stats.fill_ratio:.3f}), {stats.tokens / t_pack:,.0f} tokens/s"
    )
    print(f"peer, per sample      : {n_peer / t_peer:7.1f} samples/s  (wds + process_sample, no collation)")
    print(
        f"peer, in-batch packing: {args.samples / t_batch:7.1f} samples/s  (wds + process_sample + PackingCollator "
        f"over {per_batch} consecutive samples)"
    )
    print(
        f"wall-time ratio vlm-pack / per-sample peer: {t_peer / t_pack:.2f}x; "
        f"vlm-pack / in-batch peer: {t_batch / t_pack:.2f}x"
    )
    print(
        f"worker CPU (user+sys, all threads) per sample: vlm-pack {1e3 * cpu_pack / args.samples:.1f} ms, "
        f"per-sample peer {1e3 * cpu_peer / args.samples:.1f} ms ({cpu_pack / cpu_peer - 1:+.1%}), "
        f"in-batch peer {1e3 * cpu_batch / args.samples:.1f} ms ({cpu_pack / cpu_batch - 1:+.1%})"
    )
    total = sum(stats.time.values())
    print("CPU time of the worker threads by phase (s, summed over workers, last pass):")
    for phase in PHASES:
        own = " (vlm-pack)" if phase in OWN_PHASES else ""
        print(
            f"  {phase:<11} {stats.time.get(phase, 0.0):8.3f}  {stats.time.get(phase, 0.0) / total:6.1%}{own}"
        )
    print(
        f"vlm-pack's own share: {stats.own_time_share:.1%} (target < 10%); "
        f"decode + preprocess: {stats.time['preprocess'] / total:.1%}; "
        f"forecast {1e3 * stats.time['forecast'] / stats.samples_read:.2f} ms/sample, "
        f"collate {1e3 * stats.time['collate'] / stats.bins:.1f} ms/pack"
    )
    own = sum(stats.time[p] for p in OWN_PHASES)
    print(
        f"of which concatenating pixel_values into a fresh tensor: {1e3 * concat / stats.bins:.1f} ms/pack "
        f"({concat / total:.1%}); own share without it: {(own - concat) / total:.1%}"
    )


if __name__ == "__main__":
    main()
