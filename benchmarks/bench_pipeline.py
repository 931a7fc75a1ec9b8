"""The streaming pipeline against a plain padded loader, in the same run, on shards written independently.

The benchmark writes its own WebDataset tars with ``tarfile`` (not vlm-pack's writer): photo-like JPEGs of
--min-side..--max-side pixels, 0-2 per sample, captions (``txt``) and chat conversations (``json``), plus a
few bad samples of the kinds real shards hold (garbage image bytes, an image truncated after its header, no
text, broken JSON, two image placeholders for one image). Two loaders read them with the same Qwen2-VL
stand-in tokenizer and the Qwen2-VL image processor (released checkpoint parameters):

    vlm-pack        PackedDataLoader(PackedWebDataset(...)): header forecast, StreamPacker, decode +
                    preprocess of the packed samples, PackingCollator (mRoPE positions, cu_seqlens ...)
    padded loader   webdataset.WebDataset(urls).decode("pil") -> per sample: the image processor, the chat
                    text rendered and tokenized, image placeholders expanded (``repeat_interleave``), labels;
                    then batches of --batch samples (default: vlm-pack's mean samples per pack, measured in
                    a first pass) with the text right-padded and the vision tensors concatenated, as HF's
                    VLM collators do. Bad samples are skipped by webdataset's handler.

Both deliver the same good samples. Reported (medians over --repeats alternating runs, with the ratio of
each pair): samples per CPU-second at 0 workers (``time.process_time``: every thread of the process, so
other load on the machine does not count) and the minor page faults of those passes, samples/s at
``--workers`` workers (wall), with the load average; and vlm-pack's CPU by phase (``PipelineStats.time``,
thread CPU) in the 0-worker runs.

    .venv/bin/python benchmarks/bench_pipeline.py --samples 480 --repeats 5
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import tarfile
import tempfile
import time
import warnings

import torch
from PIL import Image, ImageDraw, ImageFilter

from vlm_pack.data.pipeline import PackedDataLoader, PackedWebDataset
from vlm_pack.data.stats import PHASES
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor

WORDS = "the a dog cat car red blue sky tree house street person sign water building left right".split()
BAD_KINDS = ("garbage_image", "truncated_image", "no_text", "broken_json", "two_placeholders")


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


def sample_files(index: int, rng: random.Random, min_side: int, max_side: int, bad: str | None) -> dict:
    """The tar members of one sample: ``{extension: bytes}`` (images ``jpg`` or ``0.jpg``, ``1.jpg``)."""
    n_images = 1 if bad in ("garbage_image", "truncated_image", "two_placeholders") else rng.choice([0, 1, 1, 1, 2])
    images = [photo(rng.randint(min_side, max_side), rng.randint(min_side, max_side), rng) for _ in range(n_images)]
    if bad == "garbage_image":
        images[0] = b"\x00not an image" * 50
    elif bad == "truncated_image":
        images[0] = images[0][: len(images[0]) // 3]
    files = {("jpg" if n_images == 1 else f"{i}.jpg"): data for i, data in enumerate(images)}
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 300)))
    if bad == "no_text":
        return files
    if bad == "broken_json":
        files["json"] = b'{"messages": [{"role": "user", "content": '
    elif index % 2 and bad is None:
        files["txt"] = text.encode()
    else:
        n_places = 2 if bad == "two_placeholders" else n_images
        question = [{"type": "image"}] * n_places + [{"type": "text", "text": "Describe it."}]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
        files["json"] = json.dumps({"messages": messages}).encode()
    return files


def write_tars(folder: str, n: int, n_bad: int, per_shard: int, min_side: int, max_side: int) -> list[str]:
    """``n`` samples (``n_bad`` of them bad, spread out) in tar shards of ``per_shard`` samples."""
    rng = random.Random(0)
    bad_at = {round((i + 0.5) * n / n_bad): BAD_KINDS[i % len(BAD_KINDS)] for i in range(n_bad)}
    urls = []
    for start in range(0, n, per_shard):
        url = os.path.join(folder, f"bench-{start // per_shard:05d}.tar")
        with tarfile.open(url, "w") as tar:
            for index in range(start, min(n, start + per_shard)):
                for ext, data in sample_files(index, rng, min_side, max_side, bad_at.get(index)).items():
                    member = tarfile.TarInfo(f"s{index:06d}.{ext}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
        urls.append(url)
    return urls


class PaddedLoader:
    """The plain loader: webdataset decode, per-sample image processor + tokenizer, padded batches."""

    def __init__(self, tok, ip) -> None:
        self.tok, self.ip = tok, ip
        self.image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
        self.merge = int(ip.merge_size) ** 2

    def text(self, sample: dict, n_images: int) -> str:
        """Qwen2-VL's chat text with one ``<|image_pad|>`` per image (the processor expands it)."""
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        if "txt" in sample:
            return image * n_images + sample["txt"] + "<|im_end|>"
        out = []
        payload = sample["json"]  # webdataset's decode parsed it
        for turn in payload["messages"]:
            content = turn["content"]
            if not isinstance(content, str):
                places = sum(part["type"] == "image" for part in content)
                if places != n_images:
                    raise ValueError(f"{places} image placeholders for {n_images} images")
                content = "".join(image if part["type"] == "image" else part["text"] for part in content)
            out.append(f"<|im_start|>{turn['role']}\n{content}<|im_end|>\n")
        return "".join(out)

    def sample(self, sample: dict) -> dict:
        names = sorted(name for name in sample if name.endswith("jpg"))
        images = [sample[name] for name in names]
        ids = torch.tensor(self.tok(self.text(sample, len(images)))["input_ids"])
        out = {}
        if images:
            vision = self.ip(images=images, return_tensors="pt")
            out = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
            repeats = torch.ones_like(ids)
            repeats[ids == self.image_id] = vision["image_grid_thw"].prod(-1) // self.merge
            ids = ids.repeat_interleave(repeats)
        out["input_ids"] = ids
        out["labels"] = ids.masked_fill(ids == self.image_id, -100)
        return out

    def collate(self, samples: list[dict]) -> dict:
        """Right-pad the text to the longest sample; concatenate the vision tensors."""
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id)
        labels = torch.full((len(samples), longest), -100)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
        out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        with_images = [s for s in samples if "pixel_values" in s]
        if with_images:
            for name in ("pixel_values", "image_grid_thw"):
                out[name] = torch.cat([s[name] for s in with_images])
        return out

    def dataset(self, urls: list[str], batch: int):
        import webdataset as wds

        return (
            wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node, handler=wds.ignore_and_continue)
            .decode("pilrgb", handler=wds.ignore_and_continue)
            .map(self.sample, handler=wds.ignore_and_continue)
            .batched(batch, collation_fn=self.collate, partial=True)
        )


def run_once(make_loader, workers: int, count) -> tuple[int, float, float, int]:
    """(samples delivered, CPU seconds of this process, wall seconds, its minor page faults) of one pass."""
    import resource

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, wall = time.process_time(), time.perf_counter()
    samples = sum(count(batch) for batch in make_loader(workers))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return samples, time.process_time() - cpu, time.perf_counter() - wall, faults


def children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=480, help="samples written, bad ones included")
    ap.add_argument("--bad", type=int, default=9)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--min-side", type=int, default=224)
    ap.add_argument("--max-side", type=int, default=768)
    ap.add_argument("--per-shard", type=int, default=40)
    ap.add_argument("--batch", type=int, default=0, help="padded loader batch size (0: vlm-pack's mean per pack)")
    ap.add_argument("--repeats", type=int, default=5, help="alternating pairs of runs per setting")
    args = ap.parse_args()
    torch.set_num_threads(1)  # what a DataLoader worker runs with; the same for both loaders at 0 workers
    warnings.simplefilter("ignore")  # the bad samples' warnings (counted in stats)
    tok, ip = build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")
    peer = PaddedLoader(tok, ip)

    def packed(workers: int):
        ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=args.capacity, shuffle_seed=0, oversized="skip")  # a too-long sample is counted as too_long, not fatal
        packed.ds = ds
        return PackedDataLoader(ds, num_workers=workers)

    def padded(workers: int):
        return torch.utils.data.DataLoader(peer.dataset(urls, batch), batch_size=None, num_workers=workers)

    count_packed = lambda b: b.num_samples  # noqa: E731
    count_padded = lambda b: len(b["input_ids"])  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_tars(tmp, args.samples, args.bad, args.per_shard, args.min_side, args.max_side)
        n_packed, *_ = run_once(packed, 0, count_packed)  # warm-up; the mean pack size
        stats = packed.ds.stats
        batch = args.batch or max(1, round(stats.samples_packed / stats.bins))
        n_padded, *_ = run_once(padded, 0, count_padded)
        assert n_packed == n_padded == args.samples - args.bad, (n_packed, n_padded)
        print(
            f"{args.samples} samples ({args.bad} bad: {', '.join(BAD_KINDS)}) in {len(urls)} tar shards; Qwen2-VL, "
            f"capacity {args.capacity}: {stats.bins} packs, {n_packed / stats.bins:.1f} samples/pack, fill "
            f"{stats.fill_ratio:.3f}, bad {dict(sorted(stats.reasons.items()))}; padded loader batches of {batch}"
        )
        load = [os.getloadavg()[0]]
        rows: dict[str, list[float]] = {k: [] for k in ("p0", "q0", "pf0", "qf0", "p2", "q2", "pc2", "qc2")}
        phases = []
        for repeat in range(args.repeats):
            order = [("p", packed, count_packed), ("q", padded, count_padded)]
            for tag, make, count in order if repeat % 2 == 0 else order[::-1]:
                n, cpu, _, faults = run_once(make, 0, count)
                rows[f"{tag}0"].append(n / cpu)
                rows[f"{tag}f0"].append(faults / 1000)
                if tag == "p":
                    phases.append(dict(packed.ds.stats.time))
            for tag, make, count in order if repeat % 2 else order[::-1]:
                c0 = children_cpu()
                n, _, wall, _ = run_once(make, args.workers, count)
                rows[f"{tag}2"].append(n / wall)
                rows[f"{tag}c2"].append(n / (children_cpu() - c0))
            load.append(os.getloadavg()[0])
    report(args, rows, phases, load)


def report(args, rows: dict[str, list[float]], phases: list[dict[str, float]], load: list[float]) -> None:
    med = statistics.median
    ratios0 = [p / q for p, q in zip(rows["p0"], rows["q0"])]
    ratios2 = [p / q for p, q in zip(rows["p2"], rows["q2"])]
    print(f"load average (1 min) during the runs: {min(load):.1f}-{max(load):.1f}; medians of {args.repeats} pairs")
    print(f"{'':34} {'vlm-pack':>10} {'padded':>10} {'ratio':>7}  pairs")
    print(
        f"{'samples per CPU-s, 0 workers':34} {med(rows['p0']):10.1f} {med(rows['q0']):10.1f} "
        f"{med(ratios0):6.2f}x  {min(ratios0):.2f}-{max(ratios0):.2f}x"
    )
    ratios_f = [p / q for p, q in zip(rows["pf0"], rows["qf0"])]
    print(
        f"{'minor page faults (k), 0 workers':34} {med(rows['pf0']):10.0f} {med(rows['qf0']):10.0f} "
        f"{med(ratios_f):6.2f}x  {min(ratios_f):.2f}-{max(ratios_f):.2f}x"
    )
    print(
        f"{f'samples/s (wall), {args.workers} workers':34} {med(rows['p2']):10.1f} {med(rows['q2']):10.1f} "
        f"{med(ratios2):6.2f}x  {min(ratios2):.2f}-{max(ratios2):.2f}x"
    )
    ratios_c = [p / q for p, q in zip(rows["pc2"], rows["qc2"])]
    print(
        f"{f'samples per worker CPU-s, {args.workers} workers':34} {med(rows['pc2']):10.1f} {med(rows['qc2']):10.1f} "
        f"{med(ratios_c):6.2f}x  {min(ratios_c):.2f}-{max(ratios_c):.2f}x"
    )
    totals = {phase: med([p.get(phase, 0.0) for p in phases]) for phase in PHASES}
    whole = sum(totals.values())
    print("vlm-pack CPU by phase (0 workers, thread CPU, median s per pass):")
    print("  " + ", ".join(f"{phase} {seconds:.2f} ({seconds / whole:.0%})" for phase, seconds in totals.items()))
    print(
        f"targets: >= 0.95x samples per CPU-s at 0 workers ({med(ratios0):.2f}x), "
        f">= 1.0x samples/s at {args.workers} workers ({med(ratios2):.2f}x)"
    )


if __name__ == "__main__":
    main()
